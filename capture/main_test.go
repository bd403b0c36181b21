package capture

import (
	"os"
	"testing"
)

func TestMain(m *testing.M) {
	if f := os.Getenv(coldChildEnv); f != "" { // BenchmarkProgramFresh's fresh process
		os.Exit(coldChild(f))
	}
	os.Exit(m.Run())
}
