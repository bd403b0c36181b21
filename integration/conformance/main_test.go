package conformance

import (
	"fmt"
	"os"
	"testing"
)

// TestMain prints the suite's result line once every case has run.
func TestMain(m *testing.M) {
	code := m.Run()
	if Suite.Configs+len(Suite.NotExpressible) > 0 {
		fmt.Print(Suite.String())
	}
	os.Exit(code)
}
