package conformance

import (
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
)

// IstioModule is the directory of the istio.io/istio module at the
// version go.mod pins (the module cache; downloaded if missing). Its test
// data is read from there, never copied into this repository.
func IstioModule(t testing.TB) string {
	t.Helper()
	istioOnce.Do(func() {
		gobin := filepath.Join(runtime.GOROOT(), "bin", "go")
		if _, err := os.Stat(gobin); err != nil {
			gobin = "go"
		}
		out, err := exec.Command(gobin, "mod", "download", "-json", "istio.io/istio").Output()
		if err != nil {
			istioErr = fmt.Errorf("go mod download istio.io/istio: %v %s", err, out)
			return
		}
		var m struct{ Dir, Version, Error string }
		if err := json.Unmarshal(out, &m); err != nil || m.Dir == "" {
			istioErr = fmt.Errorf("go mod download istio.io/istio: %v %s %s", err, m.Error, out)
			return
		}
		istioDir, istioVersion = m.Dir, m.Version
	})
	if istioErr != nil {
		if os.Getenv("NFTCNI_REQUIRE_ISTIO") != "" {
			t.Fatal(istioErr)
		}
		t.Skip(istioErr)
	}
	return istioDir
}

var (
	istioOnce              sync.Once
	istioDir, istioVersion string
	istioErr               error
)

// IstioVersion is the pinned istio.io/istio version (after IstioModule).
func IstioVersion() string { return istioVersion }

// Goldens lists the .golden files of a testdata dir of Istio's, by name
// without the extension.
func Goldens(t testing.TB, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if n, ok := strings.CutSuffix(e.Name(), ".golden"); ok {
			out = append(out, n)
		}
	}
	return out
}

// Assignments is one of Istio's test cases: the name and each `cfg.Field
// = value` its config function makes (strings, bools, string lists), or
// the fields of a struct literal.
type Assignments struct {
	Name   string
	Fields map[string]any
}

// ParseCases reads the test case table that function fn of Go file path
// returns: a slice literal of structs whose first field is the name and
// whose others are a `func(cfg *X) { cfg.F = v; ... }` or a struct
// literal. Values other than literals are an error, so that a new shape
// of Istio's tests is noticed rather than misread.
func ParseCases(path, fn string) ([]Assignments, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, nil, 0)
	if err != nil {
		return nil, err
	}
	var lit *ast.CompositeLit
	ast.Inspect(f, func(n ast.Node) bool {
		if d, ok := n.(*ast.FuncDecl); ok && d.Name.Name == fn {
			ast.Inspect(d.Body, func(n ast.Node) bool {
				if r, ok := n.(*ast.ReturnStmt); ok && len(r.Results) == 1 {
					lit, _ = r.Results[0].(*ast.CompositeLit)
				}
				return lit == nil
			})
		}
		return lit == nil
	})
	if lit == nil {
		return nil, fmt.Errorf("%s: no %s returning a case table", path, fn)
	}
	var out []Assignments
	for _, e := range lit.Elts {
		c, ok := e.(*ast.CompositeLit)
		if !ok {
			return nil, fmt.Errorf("%s: case %s is not a literal", path, fset.Position(e.Pos()))
		}
		a := Assignments{Fields: map[string]any{}}
		for i, el := range c.Elts {
			if kv, ok := el.(*ast.KeyValueExpr); ok {
				el = kv.Value
			}
			if i == 0 {
				s, err := literal(el)
				if err != nil {
					return nil, err
				}
				a.Name = s.(string)
				continue
			}
			switch v := el.(type) {
			case *ast.FuncLit:
				for _, st := range v.Body.List {
					as, ok := st.(*ast.AssignStmt)
					if !ok || len(as.Lhs) != 1 || len(as.Rhs) != 1 {
						return nil, fmt.Errorf("%s: case %q: not an assignment at %s", path, a.Name, fset.Position(st.Pos()))
					}
					sel, ok := as.Lhs[0].(*ast.SelectorExpr)
					if !ok {
						return nil, fmt.Errorf("%s: case %q: assigns to something other than a field", path, a.Name)
					}
					val, err := literal(as.Rhs[0])
					if err != nil {
						return nil, fmt.Errorf("%s: case %q, %s: %w", path, a.Name, sel.Sel.Name, err)
					}
					a.Fields[sel.Sel.Name] = val
				}
			case *ast.CompositeLit:
				for _, fe := range v.Elts {
					kv, ok := fe.(*ast.KeyValueExpr)
					if !ok {
						return nil, fmt.Errorf("%s: case %q: unkeyed field", path, a.Name)
					}
					val, err := literal(kv.Value)
					if err != nil {
						return nil, fmt.Errorf("%s: case %q, %v: %w", path, a.Name, kv.Key, err)
					}
					a.Fields[kv.Key.(*ast.Ident).Name] = val
				}
			default:
				return nil, fmt.Errorf("%s: case %q: field %d is neither a func nor a struct literal", path, a.Name, i)
			}
		}
		out = append(out, a)
	}
	return out, nil
}

// literal evaluates a string, bool or []string literal, or a selector
// (returned as its text, e.g. "config.PodDNSEnabled").
func literal(e ast.Expr) (any, error) {
	switch v := e.(type) {
	case *ast.BasicLit:
		if v.Kind == token.STRING {
			return strconv.Unquote(v.Value)
		}
	case *ast.Ident:
		switch v.Name {
		case "true":
			return true, nil
		case "false":
			return false, nil
		}
	case *ast.SelectorExpr:
		if x, ok := v.X.(*ast.Ident); ok {
			return x.Name + "." + v.Sel.Name, nil
		}
	case *ast.CompositeLit:
		var out []string
		for _, el := range v.Elts {
			s, err := literal(el)
			if err != nil {
				return nil, err
			}
			str, ok := s.(string)
			if !ok {
				return nil, fmt.Errorf("list of non-strings")
			}
			out = append(out, str)
		}
		return out, nil
	}
	return nil, fmt.Errorf("not a literal: %T", e)
}

// LoadNft loads an nft script (one of Istio's goldens) into the pod netns.
func (tw *Twin) LoadNft(t testing.TB, script string) {
	t.Helper()
	tw.Exec(t, script, "nft", "-f", "-")
}

// LoadIptables loads one of Istio's iptables goldens into the pod netns
// with iptables-restore and ip6tables-restore (iptables-nft here). The
// goldens hold the IPv4 tables, then (when IPv6 is on) the IPv6 ones.
func (tw *Twin) LoadIptables(t testing.TB, golden string) {
	t.Helper()
	v4, v6, err := SplitIptables(golden)
	if err != nil {
		t.Fatal(err)
	}
	if v4 != "" {
		tw.Exec(t, v4, "iptables-restore", "--noflush")
	}
	if v6 != "" {
		tw.Exec(t, v6, "ip6tables-restore", "--noflush")
	}
}

// SplitIptables splits a golden of Istio's iptables backend into its
// iptables-restore and ip6tables-restore input: the tables come in family
// order, so a table name seen again starts the IPv6 part; the dry-run's
// "iptables-save" lines are dropped.
func SplitIptables(golden string) (v4, v6 string, err error) {
	var cur *strings.Builder
	var b4, b6 strings.Builder
	seen := map[string]bool{}
	cur = &b4
	for _, l := range strings.Split(golden, "\n") {
		switch {
		case l == "" || l == "iptables-save" || l == "ip6tables-save":
			continue
		case strings.HasPrefix(l, "* "):
			name := strings.TrimPrefix(l, "* ")
			if seen[name] {
				if cur == &b6 {
					return "", "", fmt.Errorf("table %s three times", name)
				}
				cur, seen = &b6, map[string]bool{}
			}
			seen[name] = true
			fmt.Fprintf(cur, "*%s\n", name)
		default:
			fmt.Fprintln(cur, l)
		}
	}
	return b4.String(), b6.String(), nil
}
