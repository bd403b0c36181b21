package integration

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/nftcni/nftcni/nft"
)

// probeMembers reads the host probe set in the netns behind fd, by owner.
func probeMembers(t testing.TB, fd int) []nft.Member {
	t.Helper()
	ps, err := nft.OpenProbeSet(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.Close()
	owners, _, err := ps.Elements()
	if err != nil {
		t.Fatal(err)
	}
	return nft.Members(owners)
}

// gathered reads a counter or gauge from reg by name and label pairs; 0
// when no such series was ever set.
func gathered(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			if c := m.GetCounter(); c != nil {
				return c.GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}
