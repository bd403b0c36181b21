package main

import (
	"archive/tar"
	"bytes"
	"encoding/json"
	"github.com/nftcni/nftcni/internal/ociimage"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
)

// fakeBins writes stand-ins for the binaries.
func fakeBins(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	for _, b := range Binaries {
		if err := os.WriteFile(filepath.Join(dir, b), []byte("binary "+b), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// archive builds the image from bins at when and writes its archive,
// returning the image and the archive's path.
func archive(t *testing.T, bins string, when time.Time) (v1.Image, string) {
	t.Helper()
	img, err := Build(bins, "amd64", when)
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "img.tar")
	if err := ociimage.WriteArchive(img, "ghcr.io/nftcni/nftcni:test", out); err != nil {
		t.Fatal(err)
	}
	return img, out
}

// Same inputs, same bytes: the archive and the digest.
func TestReproducible(t *testing.T) {
	bins := fakeBins(t)
	var archives [][]byte
	for range 2 {
		_, out := archive(t, bins, time.Unix(1700000000, 0))
		b, err := os.ReadFile(out)
		if err != nil {
			t.Fatal(err)
		}
		archives = append(archives, b)
		time.Sleep(1100 * time.Millisecond) // a second apart: no wall clock may leak in
	}
	if !bytes.Equal(archives[0], archives[1]) {
		t.Error("two builds from the same inputs differ")
	}
}

// The image holds the two binaries at BinDir and nothing else (no shell),
// and runs the agent.
func TestImageContents(t *testing.T) {
	img, err := Build(fakeBins(t), "arm64", time.Unix(0, 0))
	if err != nil {
		t.Fatal(err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if cf.OS != "linux" || cf.Architecture != "arm64" || !slices.Equal(cf.Config.Entrypoint, []string{Entrypoint}) || !slices.Equal(cf.Config.Cmd, Cmd) {
		t.Errorf("config: os %s arch %s entrypoint %v cmd %v", cf.OS, cf.Architecture, cf.Config.Entrypoint, cf.Config.Cmd)
	}
	layers, err := img.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers: %d %v", len(layers), err)
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var files []string
	eachEntry(t, rc, func(h *tar.Header, _ io.Reader) {
		if h.Typeflag == tar.TypeReg {
			files = append(files, "/"+h.Name)
			if h.Mode != 0o755 || h.Uid != 0 || h.Gid != 0 {
				t.Errorf("%s: mode %o owner %d:%d", h.Name, h.Mode, h.Uid, h.Gid)
			}
		}
	})
	want := []string{BinDir + "/nftcni", BinDir + "/nftcni-agent"}
	if !slices.Equal(files, want) {
		t.Errorf("files %v, want exactly %v", files, want)
	}
}

// The Dockerfile, for users with a builder, gives the same layout.
func TestDockerfileAgrees(t *testing.T) {
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	df := string(b)
	copyRe := regexp.MustCompile(`(?m)^COPY --from=build (.+)$`)
	m := copyRe.FindStringSubmatch(df)
	if m == nil {
		t.Fatal("no COPY --from=build in the Dockerfile")
	}
	f := strings.Fields(m[1])
	var srcs []string
	for _, s := range f[:len(f)-1] {
		srcs = append(srcs, filepath.Base(s))
	}
	if dst := f[len(f)-1]; dst != BinDir+"/" || !slices.Equal(srcs, Binaries) {
		t.Errorf("Dockerfile copies %v to %s; the image has %v in %s/", srcs, dst, Binaries, BinDir)
	}
	var ep, cmd []string
	for _, l := range strings.Split(df, "\n") {
		if v, ok := strings.CutPrefix(l, "ENTRYPOINT "); ok {
			_ = json.Unmarshal([]byte(v), &ep)
		}
		if v, ok := strings.CutPrefix(l, "CMD "); ok {
			_ = json.Unmarshal([]byte(v), &cmd)
		}
	}
	if !slices.Equal(ep, []string{Entrypoint}) || !slices.Equal(cmd, Cmd) {
		t.Errorf("Dockerfile ENTRYPOINT %v CMD %v; the image's %v %v", ep, cmd, []string{Entrypoint}, Cmd)
	}
	if !strings.Contains(df, "FROM scratch") {
		t.Error("the Dockerfile's final stage is not scratch: the image would carry a shell")
	}
}

// The archive is an OCI image layout that a reader opens: one image, named.
func TestArchiveIsAnOCILayout(t *testing.T) {
	img, out := archive(t, fakeBins(t), time.Unix(0, 0))
	f, err := os.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dir := t.TempDir()
	eachEntry(t, f, func(h *tar.Header, r io.Reader) {
		p := filepath.Join(dir, filepath.FromSlash(h.Name))
		if h.Typeflag == tar.TypeDir {
			if err := os.MkdirAll(p, 0o755); err != nil {
				t.Fatal(err)
			}
			return
		}
		b, _ := io.ReadAll(r)
		if err := os.WriteFile(p, b, 0o644); err != nil {
			t.Fatal(err)
		}
	})
	idx, err := layout.ImageIndexFromPath(dir)
	if err != nil {
		t.Fatal(err)
	}
	m, err := idx.IndexManifest()
	if err != nil || len(m.Manifests) != 1 || m.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "ghcr.io/nftcni/nftcni:test" {
		t.Fatalf("index %+v %v", m, err)
	}
	want, _ := img.Digest()
	if m.Manifests[0].Digest != want {
		t.Errorf("index names %s, the image is %s", m.Manifests[0].Digest, want)
	}
}

// eachEntry calls fn for every entry of the tar stream r, with a reader
// of the entry's content.
func eachEntry(t *testing.T, r io.Reader, fn func(*tar.Header, io.Reader)) {
	t.Helper()
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		fn(h, tr)
	}
}
