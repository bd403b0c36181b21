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
	"archive/tar"
	"bytes"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
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
	if err := WriteArchive(img, *tag, *out); err != nil {
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
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	dir := func(name string) error {
		return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: name + "/", Mode: 0o755, ModTime: when, Format: tar.FormatPAX})
	}
	for _, d := range []string{"opt", "opt/nftcni", "opt/nftcni/bin"} {
		if err := dir(d); err != nil {
			return nil, err
		}
	}
	for _, b := range Binaries {
		data, err := os.ReadFile(filepath.Join(bin, b))
		if err != nil {
			return nil, fmt.Errorf("%w (run make build first)", err)
		}
		h := &tar.Header{Typeflag: tar.TypeReg, Name: BinDir[1:] + "/" + b, Mode: 0o755, Size: int64(len(data)), ModTime: when, Format: tar.FormatPAX}
		if err := tw.WriteHeader(h); err != nil {
			return nil, err
		}
		if _, err := tw.Write(data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	layerBytes := buf.Bytes()
	layer, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(layerBytes)), nil },
		tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, err
	}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{Layer: layer, History: v1.History{Created: v1.Time{Time: when}, CreatedBy: "nftcni mkimage"}})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture, cf.Created = "linux", arch, v1.Time{Time: when}
	cf.Config.Entrypoint, cf.Config.Cmd = []string{Entrypoint}, Cmd
	return mutate.ConfigFile(img, cf)
}

// WriteArchive writes img as an OCI archive (a tar of an OCI image layout)
// named tag, atomically and with fixed metadata.
func WriteArchive(img v1.Image, tag, out string) error {
	dir, err := os.MkdirTemp(filepath.Dir(out), ".mkimage-*")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		return err
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{"org.opencontainers.image.ref.name": tag})); err != nil {
		return err
	}
	tmp := out + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	tw := tar.NewWriter(f)
	err = filepath.WalkDir(dir, func(path string, d os.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, path)
		h := &tar.Header{Name: filepath.ToSlash(rel), Mode: 0o644, ModTime: time.Unix(0, 0).UTC(), Format: tar.FormatPAX}
		if d.IsDir() {
			h.Typeflag, h.Name, h.Mode = tar.TypeDir, h.Name+"/", 0o755
			return tw.WriteHeader(h)
		}
		data, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		h.Typeflag, h.Size = tar.TypeReg, int64(len(data))
		if err := tw.WriteHeader(h); err != nil {
			return err
		}
		_, err = tw.Write(data)
		return err
	})
	if err == nil {
		err = tw.Close()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return err
	}
	return os.Rename(tmp, out)
}
