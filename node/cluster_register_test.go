package node_test

import (
	"encoding/json"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// lineLog records the lines a node logs.
type lineLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *lineLog) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, string(p))
	return len(p), nil
}

// with returns the lines containing s, and their bytes.
func (l *lineLog) with(s string) (n, bytes int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		if strings.Contains(line, s) {
			n, bytes = n+1, bytes+len(line)
		}
	}
	return n, bytes
}

// dumpOnFailure logs the last lines about registers recorded when t fails:
// the node's own account of a refusal that did not come.
func (l *lineLog) dumpOnFailure(t *testing.T) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		var about []string
		for _, line := range l.lines {
			if strings.Contains(line, "register") {
				about = append(about, line)
			}
		}
		for _, line := range about[max(0, len(about)-40):] {
			t.Logf("node log: %.300s", line)
		}
	})
}

// An engine chooses how often and with what "node" it registers: a name
// that is not a node id (here 512 KiB) is refused bad_spec before any
// claim, by every node alike, with an error that does not carry it; a
// register naming another node than the owner is refused by the owner
// each time, counted each time, and logged through the rate-limited
// rejection log. Before, "node" had no bound and each refusal was an Info
// line carrying it whole: the engine wrote the node's log at its send rate.
func TestClusterRegisterRefusalsOfItsNodeAreBoundedAndRateLimited(t *testing.T) {
	t.Parallel()
	var logs lineLog
	logs.dumpOnFailure(t)
	kc := startCluster(t, 2, func(_ int, c *node.Config) {
		// The engine sends no heartbeat: the refusals must all come within
		// its lease, or n1 expires it and n0, named, serves it.
		c.Lease = 10 * time.Second
		if c.NodeID == "n1" {
			c.Log = slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug})) // a register left to another node is a Debug line
		}
	})
	te := kc.nodes[1].newEngine("e1", defaultOpts())
	te.spec.Node = "n1"
	te.register()

	long := te.spec
	long.Node = "n0" + strings.Repeat("x", 512<<10)
	replies := collect(t, kc.nodes[1].nc, "kvactors.e1.register", long)
	for range 2 { // both nodes answer a bad spec alike
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "bad_spec refusal").Data, &r))
		require.False(t, r.OK)
		require.True(t, strings.Contains(r.Error, "node is 524290 bytes"), "%.200s", r.Error)
		require.Less(t, len(r.Error), 300)
	}
	require.Equal(t, []string{"e1"}, kc.nodes[1].node.Engines(), "a bad spec changes nothing")

	other := te.spec
	other.Node = "n0"
	const refusals = 20
	for range refusals {
		replies := collect(t, kc.nodes[1].nc, "kvactors.e1.register", other)
		var r messages.RegisterReply
		require.NoError(t, json.Unmarshal(testkit.Recv(t, replies, 5*time.Second, "refusal").Data, &r))
		require.False(t, r.OK)
		require.Contains(t, r.Error, "owned by node n1")
	}
	require.Equal(t, float64(refusals+1), kc.nodes[1].counter("kvactors_events_rejected_total", messages.RejectBadSpec))
	lines, bytes := logs.with("names another node")
	require.LessOrEqual(t, lines, 5, "rate-limited: a few lines per reason per window")
	require.Less(t, bytes, 64<<10)
	_, bytes = logs.with("register refused")
	require.Less(t, bytes, 64<<10, "the bad spec's log does not carry the name")
}
