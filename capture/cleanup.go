package capture

import (
	"github.com/nftcni/nftcni/istio"
	"github.com/nftcni/nftcni/nft"
)

// PodCleanup names everything a pod ruleset of any kind can leave in a pod
// netns: our table and the policy routes of both the ambient and the TPROXY
// sidecar rulesets, v4 and v6. nft.Delete(fd, PodCleanup()) undoes either
// without knowing which one was applied.
func PodCleanup() *nft.Ruleset {
	rs := &nft.Ruleset{Tables: []*nft.Table{{Name: nft.PodTable}}}
	rs.Routes = append(rs.Routes, Ambient(AmbientSpec{IPv6: true}).Routes...)
	rs.Routes = append(rs.Routes, Sidecar(SidecarSpec{Mode: istio.ModeTProxy, IPv6: true}).Routes...)
	return rs
}
