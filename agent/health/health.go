// Package health serves the agent's /healthz and /readyz endpoints.
package health

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// Check reports nil when its part of the agent is ready.
type Check func() error

// Handler answers /healthz with 200 while the process serves, and /readyz
// with 200 only when every check passes (503 with the reasons otherwise).
func Handler(checks ...Check) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		var errs []error
		for _, c := range checks {
			errs = append(errs, c())
		}
		if err := errors.Join(errs...); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok\n"))
	})
	return mux
}

// Serve listens on addr and serves h until ctx ends. It returns the bound
// address (useful with ":0") once listening.
func Serve(ctx context.Context, addr string, h http.Handler, log *slog.Logger) (net.Addr, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	go func() {
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("http server stopped", "addr", ln.Addr().String(), "err", err)
		}
	}()
	return ln.Addr(), nil
}
