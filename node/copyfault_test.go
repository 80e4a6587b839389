package node_test

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/node"
)

// docs/SECURITY.md "Bounds": hostile input costs a few log lines per reason
// per minute. An engine that truncates its own segment makes every load
// copy fault (shm.ErrFault): each load is answered with the error and
// counted, but only the first few failures are logged in full.
func TestFaultingLoadCopiesAreLogRateLimited(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	hs := []string{hash("a", 0)}
	te.fill(0, 5, 1)
	te.send(added("r", 4), hashesEv("r", 0, hs...), blocksEv("r", 0, 0, 5), tokensEv("r", 4, 4))
	recv(t, te.stored, "stored")
	require.NoError(t, os.Truncate(filepath.Join(e.dir, te.seg.Name()), 0))

	const loads = 50
	for range loads {
		r := te.loadInto("l", hs, 4, []int{9})
		require.False(t, r.OK)
		require.Contains(t, r.Error, "copy failed")
	}
	// The actor logs before it replies: every line is written by now.
	require.Equal(t, float64(loads), metricValue(t, e.reg, "kvactors_load_requests_total",
		map[string]string{"result": "error"}), "every failed load counted")
	require.Equal(t, 5, strings.Count(logs.String(), "load copy failed"), "the log holds the first few only")
}

// The same for stores: every store copy of a truncated segment faults and is
// retried; each failure is counted, the first few logged.
func TestFaultingStoreCopiesAreLogRateLimited(t *testing.T) {
	t.Parallel()
	var logs testkit.SyncBuffer
	e := startNode(t, func(c *node.Config) { c.Log = slog.New(slog.NewTextHandler(&logs, nil)) })
	te := e.newEngine("e1", defaultOpts())
	te.register()
	require.NoError(t, os.Truncate(filepath.Join(e.dir, te.seg.Name()), 0))

	const requests = 30
	var evs []map[string]any
	for i := range requests {
		r := fmt.Sprintf("r%d", i)
		evs = append(evs, added(r, 4), hashesEv(r, 0, hash(r, 0)), blocksEv(r, 0, 0, i+1), tokensEv(r, 4, 4))
	}
	te.send(evs...)
	// A request actor logs a failed copy (if at all) before it counts the
	// retry: once the retries are counted, every line is written.
	testkit.Eventually(t, 10*time.Second, 10*time.Millisecond, func() error {
		got := metricValue(t, e.reg, "kvactors_store_retries_total", map[string]string{"reason": "copy_failed"})
		if got < requests {
			return fmt.Errorf("%v of at least %d failed store copies retried", got, requests)
		}
		return nil
	})
	require.GreaterOrEqual(t, metricValue(t, e.reg, "kvactors_transfer_failures_total",
		map[string]string{"transfer_type": "GPU_to_CPU"}), float64(requests), "every failed copy counted")
	require.Equal(t, 5, strings.Count(logs.String(), "store copy failed"), "the log holds the first few only")
}
