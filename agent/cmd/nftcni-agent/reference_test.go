package main

import (
	"bytes"
	"os"
	"testing"
)

// docs/config-reference.md is generated from the flags; regenerate it with
// `make docs` when this fails.
func TestConfigReferenceIsUpToDate(t *testing.T) {
	var b bytes.Buffer
	writeReference(&b)
	have, err := os.ReadFile("../../../docs/config-reference.md")
	if err != nil {
		t.Fatalf("%v: run `make docs`", err)
	}
	if !bytes.Equal(have, b.Bytes()) {
		t.Fatal("docs/config-reference.md is out of date with the flag definitions: run `make docs`")
	}
}

// Every flag has an env twin, and no two flags share one.
func TestEveryFlagHasOneEnvVar(t *testing.T) {
	for _, c := range commands() {
		seen := map[string]string{}
		for name, env := range c.flags.env {
			if env == "" {
				t.Errorf("%s --%s has no env var", c.name, name)
			}
			if other, dup := seen[env]; dup {
				t.Errorf("%s: --%s and --%s share %s", c.name, name, other, env)
			}
			seen[env] = name
		}
	}
}
