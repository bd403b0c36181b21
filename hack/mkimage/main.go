// Command mkimage builds the nftcni image as an OCI archive from the
// binaries `make build` made, without a container builder or a registry:
// the same file layout, entrypoint and command as the Dockerfile (a test
// holds them to agree), on an empty base (no shell, no iptables, no nft).
// The same inputs give the same digest: every timestamp is the commit's
// (SOURCE_DATE_EPOCH) or zero, owners are root, modes fixed.
//
// Usage: mkimage -bin bin -tag ghcr.io/nftcni/nftcni:VERSION -out bin/nftcni-image.oci.tar
package main

import (
	"flag"
	"fmt"
	"github.com/nftcni/nftcni/internal/ociimage"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// The image's layout; the Dockerfile's COPY and ENTRYPOINT say the same.
const (
	BinDir     = "/opt/nftcni/bin"
	Entrypoint = BinDir + "/nftcni-agent"
)

// Binaries are the files the image holds, in BinDir.
var Binaries = []string{"nftcni", "nftcni-agent"}

// Cmd is the image's default command.
var Cmd = []string{"run"}

func main() {
	bin := flag.String("bin", "bin", "dir holding the built binaries")
	tag := flag.String("tag", "ghcr.io/nftcni/nftcni:dev", "the image's name in the archive")
	out := flag.String("out", "bin/nftcni-image.oci.tar", "the OCI archive to write")
	arch := flag.String("arch", runtime.GOARCH, "the binaries' architecture")
	flag.Parse()
	when := time.Unix(0, 0).UTC()
	if s := os.Getenv("SOURCE_DATE_EPOCH"); s != "" {
		sec, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			fail(fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", s, err))
		}
		when = time.Unix(sec, 0).UTC()
	}
	img, err := Build(*bin, *arch, when)
	if err != nil {
		fail(err)
	}
	if err := ociimage.WriteArchive(img, *tag, *out); err != nil {
		fail(err)
	}
	d, _ := img.Digest()
	fmt.Printf("%s %s %s\n", *out, *tag, d)
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "mkimage:", err)
	os.Exit(1)
}

// Build makes the image from the binaries in bin.
func Build(bin, arch string, when time.Time) (v1.Image, error) {
	var files []ociimage.File
	for _, b := range Binaries {
		data, err := os.ReadFile(filepath.Join(bin, b))
		if err != nil {
			return nil, fmt.Errorf("%w (run make build first)", err)
		}
		files = append(files, ociimage.File{Path: BinDir + "/" + b, Data: data})
	}
	return ociimage.Build(files, ociimage.Config{Entrypoint: []string{Entrypoint}, Cmd: Cmd, Arch: arch, Created: when})
}
