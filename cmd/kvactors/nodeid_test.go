package main

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// Two real `kvactors serve` processes with one --node-id on one NATS: the
// second refuses to start and exits non-zero, naming the running boot;
// once the first is killed (SIGKILL: no goodbye), the same command starts
// at once with a new boot: the killed process's subscription went with its
// connection, so no probe waits on a silent holder.
func TestServeRefusesANodeIDARunningProcessServes(t *testing.T) {
	s, nc := testkit.NATS(t)
	hellos := testkit.Subscribe(t, nc, "kvactors._node.dup.hello")
	dir := t.TempDir()
	var logs testkit.SyncBuffer
	serve := func() *exec.Cmd {
		cmd := exec.Command(binary, "serve", "--nats", s.ClientURL(), "--node-id", "dup", "--lease", "2s",
			"--shm-dir", dir, "--pool-bytes", "1M", "--http", "off", "--log-level", "warn")
		cmd.Stdout, cmd.Stderr = os.Stdout, io.MultiWriter(os.Stderr, &logs)
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	boot := func() string {
		var h messages.Hello
		require.NoError(t, json.Unmarshal(testkit.Recv(t, hellos, 20*time.Second, "a hello").Data, &h))
		return h.Boot
	}
	first := serve()
	running := boot()

	second := exec.Command(binary, "serve", "--nats", s.ClientURL(), "--node-id", "dup", "--lease", "2s",
		"--shm-dir", dir, "--pool-bytes", "1M", "--http", "off", "--log-level", "warn")
	out, err := second.CombinedOutput()
	var exit *exec.ExitError
	require.True(t, errors.As(err, &exit), "the second process exits with an error: %v\n%s", err, out)
	require.Equal(t, 1, exit.ExitCode())
	require.Contains(t, string(out), "node id in use")
	require.Contains(t, string(out), running, "names the running boot")

	require.NoError(t, first.Process.Signal(syscall.SIGKILL))
	_ = first.Wait()
	serve()
	require.NotEqual(t, running, boot(), "started again, a new boot")
	require.NotContains(t, logs.String(), "did not answer", "at once: no silent holder waited for")
}
