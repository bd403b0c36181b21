package health

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

func TestReadyzReflectsChecks(t *testing.T) {
	var err error = errors.New("no valid CNI network configuration in /etc/cni/net.d")
	h := Handler(func() error { return err })
	get := func(path string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code, rec.Body.String()
	}
	if code, body := get("/readyz"); code != http.StatusServiceUnavailable || !strings.Contains(body, "/etc/cni/net.d") {
		t.Errorf("not ready: %d %q", code, body)
	}
	if code, _ := get("/healthz"); code != http.StatusOK {
		t.Errorf("healthz %d", code)
	}
	err = nil
	if code, _ := get("/readyz"); code != http.StatusOK {
		t.Errorf("ready: %d", code)
	}
}
