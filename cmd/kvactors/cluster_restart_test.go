package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/internal/testkit"
)

// restartLease is long enough that a claim made before the old record
// lapses is told apart from one made after it.
const restartLease = 4 * time.Second

// kill -9 of a clustered node and a restart with the same --node-id (a new
// boot): the new boot takes its engine back by compare-and-set on the old
// boot's record at once, well before that record would lapse, rather than
// waiting out the lease; the engine sees the new boot, resyncs, and its
// request live across the restart is released once, by the new boot.
func TestClusterNodeRestartedWithItsIDTakesItsEngineBackAtOnce(t *testing.T) {
	nc3 := testkit.NATSCluster(t, 3)
	dir := t.TempDir()
	serve := func() *exec.Cmd {
		cmd := exec.Command(binary, "serve", "--nats", nc3.URLs(0), "--cluster", "--cluster-replicas", "3",
			"--node-id", "nA", "--lease", restartLease.String(), "--shm-dir", dir, "--pool-bytes", "1M",
			"--http", "off", "--log-level", "warn")
		cmd.Stdout, cmd.Stderr = io.Discard, os.Stderr
		require.NoError(t, cmd.Start())
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		return cmd
	}
	a := serve()

	spec, _ := engineSpec(t, dir, "e1", "nA")
	enc, err := nats.Connect(nc3.URLs(1), client.Options("e1")...)
	require.NoError(t, err)
	t.Cleanup(enc.Close)
	rel := &releases{got: map[string][]string{}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	c, err := client.Connect(ctx, enc, client.Config{Engine: "e1", Spec: spec, OnReleased: rel.add,
		RequestTimeout: 300 * time.Millisecond, Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	cancel()
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	oldBoot := c.Stats().Boot
	require.NoError(t, c.Added("r", 16))
	require.NoError(t, c.Flush())

	require.NoError(t, a.Process.Signal(syscall.SIGKILL))
	killed := time.Now()
	_ = a.Wait()
	serve()

	testkit.Eventually(t, restartLease, 10*time.Millisecond, func() error {
		if st := c.Stats(); st.Node != "nA" || st.Boot == oldBoot || st.Resyncs["new_boot"] == 0 {
			return fmt.Errorf("e1 on %s/%s, resyncs %v", st.Node, st.Boot, st.Resyncs)
		}
		return nil
	})
	back := time.Since(killed)
	t.Logf("the new boot served e1 %v after the kill (lease %v)", back, restartLease)
	require.Less(t, back, restartLease-time.Second, "claimed by CAS on the old boot's record, not after it lapsed")

	require.NoError(t, c.Finished("r", false, 0, 16))
	require.NoError(t, c.Flush())
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		if len(rel.of("r")) == 0 {
			return fmt.Errorf("r not released yet")
		}
		return nil
	})
	require.Equal(t, []string{"finished"}, rel.of("r"), "released once, by the new boot")
}
