package conformance

import (
	"fmt"
	"os"
	"testing"
)

// TestMain prints the suite's result line once every case has run, and
// writes it to $NFTCNI_CONFORMANCE_REPORT when set (make test prints that
// file: go test shows a passing package's output only with -v).
func TestMain(m *testing.M) {
	code := m.Run()
	if Suite.Configs+len(Suite.NotExpressible) > 0 {
		fmt.Print(Suite.String())
		if p := os.Getenv("NFTCNI_CONFORMANCE_REPORT"); p != "" {
			if err := os.WriteFile(p, []byte(Suite.String()), 0o644); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
		}
	}
	os.Exit(code)
}
