package main

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
)

// The admin server is up before the NATS wait: an --http port in use fails
// the start at once, naming the flag, rather than after the connect
// timeout (or never, when NATS stays unreachable); and while serve waits
// for NATS, /healthz answers (the process is alive) and /readyz says it is
// starting.
func TestTheAdminServerIsUpBeforeTheNATSWait(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer busy.Close()
	start := time.Now()
	out, err := exec.Command(binary, "serve", "--nats", "nats://127.0.0.1:1", "--nats-connect-timeout", "60s",
		"--http", busy.Addr().String(), "--shm-dir", t.TempDir()).CombinedOutput()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit, "%s", out)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, string(out), "address already in use")
	require.Contains(t, string(out), "--http")
	require.Less(t, time.Since(start), 30*time.Second, "not after the 60 s NATS wait")

	free, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := free.Addr().String()
	require.NoError(t, free.Close())
	cmd := exec.Command(binary, "serve", "--nats", "nats://127.0.0.1:1", "--nats-connect-timeout", "60s",
		"--http", addr, "--shm-dir", t.TempDir())
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	get := func(path string) (int, string, error) {
		resp, err := http.Get("http://" + addr + path)
		if err != nil {
			return 0, "", err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), nil
	}
	testkit.Eventually(t, 20*time.Second, 20*time.Millisecond, func() error {
		code, _, err := get("/healthz")
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("/healthz %d", code)
		}
		return err
	})
	code, body, err := get("/readyz")
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, code)
	require.True(t, strings.Contains(body, "starting"), body)
	code, _, err = get("/metrics")
	require.NoError(t, err)
	require.Equal(t, http.StatusServiceUnavailable, code, "nothing else is served while the node is built")
}
