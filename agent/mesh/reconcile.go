package mesh

import (
	"context"
	"errors"
	"fmt"
	"net/netip"

	corev1 "k8s.io/api/core/v1"

	"github.com/nftcni/nftcni/agent/enablement"
	"github.com/nftcni/nftcni/nft"
	"github.com/nftcni/nftcni/plugin/wire"
)

// ErrNoNetns means a pod should be enrolled but the agent holds no netns
// for it (it started before this agent knew it).
var ErrNoNetns = errors.New("no netns known for the pod")

// Reconcile brings one pod in line with the policy after its labels, its
// namespace's labels or its phase changed: late enrolment and unenrolment,
// done by the agent itself with the netns it kept from the pod's ADD. A
// pod that is gone or finished is released.
func (m *Mesh) Reconcile(ctx context.Context, namespace, name string) error {
	pod := m.store.Pod(namespace, name)
	key := namespace + "/" + name
	m.mu.Lock()
	var atts []*Member
	for _, mb := range m.members {
		if mb.Pod.Key() == key {
			atts = append(atts, mb)
		}
	}
	m.mu.Unlock()
	if pod == nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		for _, mb := range atts {
			if mb.Mode == wire.ModeAmbient {
				m.release(ctx, mb, pod != nil)
				m.setMode(mb, &wire.Decision{Mode: wire.ModeNone}) // its DEL has nothing left to release
			}
		}
		return nil
	}
	var errs []error
	for _, mb := range atts {
		if string(pod.UID) != "" && mb.UID != string(pod.UID) {
			continue // an older pod of the same name
		}
		d := m.policy.Decide(pod, m.store.Namespace(namespace), mb.Pod.IPs)
		switch {
		case mb.Mode == wire.ModeNone && d.Mode == wire.ModeAmbient:
			errs = append(errs, m.enrolLate(ctx, mb, d))
		case mb.Mode == wire.ModeAmbient && d.Mode != wire.ModeAmbient:
			errs = append(errs, m.unenrol(ctx, mb))
		}
	}
	if len(atts) == 0 && len(podIPs(pod)) > 0 {
		ips := podIPs(pod)
		if d := m.policy.Decide(pod, m.store.Namespace(namespace), ips); d.Mode == wire.ModeAmbient {
			mb, err := m.adopt(pod, ips)
			if err != nil {
				// Retrying cannot help until the pod changes.
				m.log.Info("pod should be enrolled but its netns was not found; it is enrolled when its sandbox is next created", "pod", key, "err", err)
				return nil
			}
			errs = append(errs, m.enrolLate(ctx, mb, d))
		}
	}
	return errors.Join(errs...)
}

// podIPs are the pod's addresses from its status.
func podIPs(p *corev1.Pod) []netip.Prefix {
	var raw []string
	for _, ip := range p.Status.PodIPs {
		raw = append(raw, ip.IP)
	}
	if len(raw) == 0 && p.Status.PodIP != "" {
		raw = append(raw, p.Status.PodIP)
	}
	var out []netip.Prefix
	for _, r := range raw {
		if a, err := netip.ParseAddr(r); err == nil {
			out = append(out, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	return out
}

// adopt finds a running pod's netns through Finder and records the pod as
// known (not enrolled). Its sandbox's container ID is unknown, so the
// attachment is named after the pod UID.
func (m *Mesh) adopt(pod *corev1.Pod, ips []netip.Prefix) (*Member, error) {
	if m.opts.Finder == nil {
		return nil, ErrNoNetns
	}
	f, err := m.opts.Finder.Find(string(pod.UID), addrs(ips))
	if err != nil {
		return nil, err
	}
	mb := &Member{UID: string(pod.UID), Mode: wire.ModeNone, decision: &wire.Decision{Mode: wire.ModeNone}, netns: f,
		Pod: wire.Pod{Namespace: pod.Namespace, Name: pod.Name, UID: string(pod.UID), IPs: ips,
			Attachment: wire.Attachment{ContainerID: "found:" + string(pod.UID), IfName: "eth0"}}}
	m.mu.Lock()
	if old := m.members[mb.Pod.Attachment]; old != nil {
		old.netns.Close()
	}
	m.members[mb.Pod.Attachment] = mb
	m.saveMember(mb)
	m.mu.Unlock()
	m.log.Info("found a running pod's netns through /proc", "pod", pod.Namespace+"/"+pod.Name, "uid", pod.UID)
	return mb, nil
}

// enrolLate enrols a running pod: ztunnel first, then the rules, then the
// probe set and the annotation, as for a new pod.
func (m *Mesh) enrolLate(ctx context.Context, mb *Member, d *wire.Decision) error {
	p := &mb.Pod
	if m.opts.Ztunnel != nil {
		if err := m.opts.Ztunnel.Add(ctx, mb.UID, m.workload(p), mb.netns); err != nil {
			return fmt.Errorf("enrolling pod %s: %w", p.Key(), err)
		}
	}
	rs, err := d.Ruleset()
	if err == nil {
		err = nft.Apply(int(mb.netns.Fd()), rs)
	}
	if err != nil {
		if m.opts.Ztunnel != nil {
			m.opts.Ztunnel.Del(mb.UID)
		}
		return fmt.Errorf("enrolling pod %s: programming its rules: %w", p.Key(), err)
	}
	m.hostMu.Lock()
	err = m.addProbe(mb.UID, p.IPs)
	if err == nil {
		m.setMode(mb, d)
	}
	m.hostMu.Unlock()
	if err != nil {
		return err
	}
	if m.opts.Annotator != nil {
		if err := m.opts.Annotator.SetRedirection(ctx, p.Namespace, p.Name, RedirectionEnabled); err != nil {
			return fmt.Errorf("annotating pod %s: %w", p.Key(), err)
		}
	}
	m.log.Info("pod enrolled by the agent (late enrolment)", "pod", p.Key(), "uid", mb.UID)
	return nil
}

// unenrol takes a running pod out of the mesh: its rules, ztunnel's hold,
// its probe entries and its annotation go; its netns stays known.
func (m *Mesh) unenrol(ctx context.Context, mb *Member) error {
	p := &mb.Pod
	if err := nft.Delete(int(mb.netns.Fd()), nft.PodCleanup()); err != nil {
		return fmt.Errorf("unenrolling pod %s: removing its rules: %w", p.Key(), err)
	}
	m.release(ctx, mb, true)
	m.setMode(mb, &wire.Decision{Mode: wire.ModeNone})
	m.log.Info("pod unenrolled", "pod", p.Key(), "uid", mb.UID)
	return nil
}

// release drops what enrolment holds outside the pod: ztunnel, the probe
// set, and (for a pod that still exists) the annotation.
func (m *Mesh) release(ctx context.Context, mb *Member, annotated bool) {
	p := &mb.Pod
	if m.opts.Ztunnel != nil {
		m.opts.Ztunnel.Del(mb.UID)
	}
	m.hostMu.Lock()
	if err := m.removeProbe(mb.UID, p.IPs); err != nil {
		m.log.Warn("could not remove pod IPs from the host probe set", "pod", p.Key(), "err", err)
	}
	m.hostMu.Unlock()
	if annotated && m.opts.Annotator != nil {
		if err := m.opts.Annotator.SetRedirection(ctx, p.Namespace, p.Name, ""); err != nil {
			m.log.Warn("could not remove the enrolment annotation", "pod", p.Key(), "annotation", enablement.AnnRedirection, "err", err)
		}
	}
}

// setMode records a member's new decision.
func (m *Mesh) setMode(mb *Member, d *wire.Decision) {
	m.mu.Lock()
	mb.Mode, mb.decision = d.Mode, d
	m.saveMember(mb)
	m.mu.Unlock()
}
