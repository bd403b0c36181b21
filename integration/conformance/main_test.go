package conformance

import (
	"os"
	"testing"
)

// TestMain prints the suite's result once every case has run.
func TestMain(m *testing.M) {
	code := m.Run()
	Suite.Print(os.Stdout, "goldens:")
	os.Exit(code)
}
