package integration

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

var (
	mdLink    = regexp.MustCompile(`\]\(([^)\s]+)\)`)
	mdHeading = regexp.MustCompile(`(?m)^#+ (.*)$`)
	notAnchor = regexp.MustCompile(`[^\w\- ]`)
)

// anchors are the heading anchors GitHub makes for a Markdown file.
func anchors(md string) map[string]bool {
	out := map[string]bool{}
	for _, m := range mdHeading.FindAllStringSubmatch(md, -1) {
		a := notAnchor.ReplaceAllString(strings.ToLower(strings.TrimSpace(m[1])), "")
		out[strings.ReplaceAll(a, " ", "-")] = true
	}
	return out
}

// Every relative link in the README, docs/ and the chart's README resolves
// in a clone, down to the heading it points at.
func TestDocLinksResolve(t *testing.T) {
	files, _ := filepath.Glob("../docs/*.md")
	files = append(files, "../README.md", "../deploy/charts/nftcni/README.md")
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mdLink.FindAllStringSubmatch(string(b), -1) {
			link := m[1]
			if strings.Contains(link, "://") || strings.HasPrefix(link, "mailto:") {
				continue
			}
			path, frag, _ := strings.Cut(link, "#")
			target := f
			if path != "" {
				target = filepath.Join(filepath.Dir(f), path)
			}
			tb, err := os.ReadFile(target)
			if err != nil {
				if st, serr := os.Stat(target); serr == nil && st.IsDir() {
					continue
				}
				t.Errorf("%s: link %s: %v", f, link, err)
				continue
			}
			if frag != "" && strings.HasSuffix(target, ".md") && !anchors(string(tb))[frag] {
				t.Errorf("%s: link %s: no heading #%s in %s", f, link, frag, target)
			}
		}
	}
}

// One pin for Istio: the cache dir of Istio's binaries (the Makefile's
// ISTIO_BIN, istiotest's default) names the commit go.mod pins, which
// hack/istio-bins.sh builds and the conformance suite reads test data from.
func TestIstioPinIsOne(t *testing.T) {
	gomod, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*istio\.io/istio v\S+-([0-9a-f]{12})$`).FindSubmatch(gomod)
	if m == nil {
		t.Fatal("go.mod pins no istio.io/istio pseudo-version")
	}
	commit := string(m[1])
	for _, f := range []string{"../Makefile", "istiotest/istiotest.go", "../README.md"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(string(b), "istio-"+commit) && !strings.Contains(string(b), "commit "+commit) {
			t.Errorf("%s does not name Istio's commit %s, which go.mod pins", f, commit)
		}
	}
}
