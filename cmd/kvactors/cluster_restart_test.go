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
// boot): the new boot answers the engine's heartbeat "unknown engine" (its
// previous boot's engines, read from the bucket at start), so the engine
// sees the restart at once, waits out its frees (a lease from the old
// boot's last sign of life: a restart that overlapped the old process
// would still be copying) and registers; the new boot takes the record back
// by compare-and-set. Within a lease and a heartbeat period of the kill,
// where without the answer the engine would first have to declare the
// node lost by silence (about twice as long). Its request live across the
// restart is released once, by the new boot.
func TestClusterNodeRestartedWithItsIDServesItsEngineAgainWithinALease(t *testing.T) {
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

	testkit.Eventually(t, 3*restartLease, 10*time.Millisecond, func() error {
		if st := c.Stats(); st.Node != "nA" || st.Boot == oldBoot || st.Resyncs["new_boot"] == 0 {
			return fmt.Errorf("e1 on %s/%s, resyncs %v", st.Node, st.Boot, st.Resyncs)
		}
		return nil
	})
	back := time.Since(killed)
	t.Logf("the new boot served e1 %v after the kill (lease %v)", back, restartLease)
	require.GreaterOrEqual(t, back, restartLease*3/4, "not before the old boot's fence: the frees wait a lease from its last sign of life")
	require.Less(t, back, restartLease+restartLease/4+500*time.Millisecond, "told at once, not after a lease of silence")

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
