package nft

import "net/netip"

// Host is the kernel of the host netns as the agent uses it: the probe
// table's sets changed element by element over a lasting connection and
// read back, the table verified, applied and deleted whole, and what
// istio-cni left there surveyed and removed. HostKernel is the real one;
// FakeHost keeps it in memory for the callers' tests.
type Host interface {
	// Update deletes dels, then adds adds, in one transaction (ProbeSet).
	Update(dels []netip.Addr, adds []Element) error
	// Elements reads the probe sets' elements and their owners; ok is
	// false when the table is not there.
	Elements() (owners map[netip.Addr]string, ok bool, err error)
	Verify(rs *Ruleset) error
	Apply(rs *Ruleset) error
	Delete(rs *Ruleset) error
	// SurveyIstio says what of istio-cni's host state is there
	// (SurveyHost); RemoveIstio removes it (RemoveIstioHost), and
	// DestroyIstioProbeSets its ipsets once nothing uses them.
	SurveyIstio() (*IstioState, error)
	RemoveIstio(s *IstioState) error
	DestroyIstioProbeSets() error
	Close() error
}

var (
	_ Host = (*HostKernel)(nil)
	_ Host = (*FakeHost)(nil)
)

// HostKernel is Host through netlink, in the netns behind fd (which the
// caller keeps open).
type HostKernel struct {
	fd int
	*ProbeSet
}

// OpenHost connects to nf_tables in the host netns behind fd.
func OpenHost(fd int) (*HostKernel, error) {
	set, err := OpenProbeSet(fd)
	if err != nil {
		return nil, err
	}
	return &HostKernel{fd: fd, ProbeSet: set}, nil
}

func (k *HostKernel) Verify(rs *Ruleset) error          { return Verify(k.fd, rs) }
func (k *HostKernel) Apply(rs *Ruleset) error           { return Apply(k.fd, rs) }
func (k *HostKernel) Delete(rs *Ruleset) error          { return Delete(k.fd, rs) }
func (k *HostKernel) SurveyIstio() (*IstioState, error) { return SurveyHost(k.fd) }
func (k *HostKernel) RemoveIstio(s *IstioState) error   { return RemoveIstioHost(k.fd, s) }
func (k *HostKernel) DestroyIstioProbeSets() error      { return DestroyIstioProbeSets(k.fd) }
