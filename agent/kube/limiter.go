package kube

import "golang.org/x/time/rate"

// newLimiter is the queue's overall bucket: 10 reconciles a second, bursts
// of 100 (istio-cni's values).
func newLimiter() *rate.Limiter { return rate.NewLimiter(rate.Limit(10), 100) }
