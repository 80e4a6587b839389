package node_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// churnEnds are the ways a churn cycle's engine leaves the node.
var churnEnds = []string{"unregister", "unregister-live", "resync-expire", "lapse-unregister"}

// A node runs for weeks while engines come and go under fresh ids: each
// ends another way (an unregister with nothing live, one with a request
// still live, a resync into a new epoch then silence until its lease
// expires, a lapse's reset then an unregister), after storing a chunk and
// loading it back (bytes compared). Once each is gone, nothing of it is
// left on the node: goroutines, actors in the actor system's registry,
// the embedded server's subscriptions, the engine segments' mappings
// (/proc/self/maps), and the node's per-engine maps are back to what they
// were after a warm-up round; what is kept per id on purpose for the boot
// (cleared, releases, epochs: departed.go; namespaces: isolation.go) grows
// by one per fresh id at most. KVACTORS_CHURN_CYCLES sets the cycles (8).
func TestEngineChurnLeavesNothingBehind(t *testing.T) {
	cycles := 8
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_CHURN_CYCLES")); err == nil && v > 0 {
		cycles = v
	}
	const lease = 2 * time.Second
	var offset atomic.Int64 // the liveness clock's lead: an expiry without waiting a lease
	e := startNode(t, func(c *node.Config) { c.Lease = lease },
		node.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))

	n := 0
	cycle := func(end string) {
		t.Helper()
		n++
		id := fmt.Sprintf("churn%d", n)
		te := e.newEngine(id, defaultOpts())
		te.register()
		hs := []string{hash(id, 0)}
		te.fill(0, 1, byte(n))
		te.send(added("s", 4), hashesEv("s", 0, hs...), blocksEv("s", 0, 0, 1), tokensEv("s", 4, 4),
			finishedEv("s", false, 4, 4))
		recv(t, te.stored, id+" stored")
		r := te.loadInto("l", hs, 4, []int{9})
		require.True(t, r.OK, r.Error)
		require.True(t, bytes.Equal(te.block(0, 1), te.block(0, 9)), "%s: loaded bytes differ", id)
		recv(t, te.released, id+" s released")

		live := 0
		switch end {
		case "unregister":
		case "unregister-live":
			te.send(added("live", 4), blocksEv("live", 0, 0, 2))
			live = 1
		case "resync-expire":
			te.seq++ // a batch lost: a resync, and the engine goes on in a new epoch
			te.send(added("old", 4))
			recv(t, te.resync, id+" resync")
			te.epoch, te.seq = "ep2", 0
			te.send(added("live", 4), blocksEv("live", 0, 0, 2))
			live = 1
		case "lapse-unregister":
			te.send(added("old", 4), blocksEv("old", 0, 0, 2))
			te.sync()
			e.node.RecordLapse()
			recv(t, te.released, id+" old reset at the lapse")
			require.NoError(t, e.node.Ping())
			recv(t, te.resync, id+" resync at the lapse's end")
			te.sync()
			te.epoch, te.seq = "ep2", 0
			te.send(added("live", 4), blocksEv("live", 0, 0, 2))
			live = 1
		}
		te.sync()
		if end == "resync-expire" {
			offset.Add(int64(2 * lease))
			testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
				if ids := e.node.Engines(); len(ids) > 0 {
					return fmt.Errorf("%v still registered", ids)
				}
				return nil
			})
		} else {
			require.Equal(t, live, te.unregister().Released, "%s: requests live at the unregister", id)
		}
		for range live {
			recv(t, te.released, id+" live released")
		}
		// The engine process is gone: its subscriptions and its own mapping.
		for _, w := range te.subs {
			require.NoError(t, w.sub.Unsubscribe())
		}
		require.NoError(t, e.nc.Flush())
		require.NoError(t, te.seg.Remove())
	}
	round := func() {
		for _, end := range churnEnds {
			cycle(end)
		}
	}
	settled := func(base map[string]int, goroutines int) {
		t.Helper()
		testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
			var diffs []string
			if g := runtime.NumGoroutine(); g > goroutines+3 {
				diffs = append(diffs, fmt.Sprintf("goroutines %d, baseline %d", g, goroutines))
			}
			if m := segmentMappings(t, e.dir); m != 0 {
				diffs = append(diffs, fmt.Sprintf("%d mappings of engine segments", m))
			}
			diffs = append(diffs, footprintDiffs("", base, e.node.Footprint(), cycles)...)
			if len(diffs) > 0 {
				return fmt.Errorf("%s", strings.Join(diffs, "; "))
			}
			return nil
		})
	}

	round() // warm-up: what is made once (pools, loops, lazily made maps)
	var base map[string]int
	goroutines := 0
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		base, goroutines = e.node.Footprint(), runtime.NumGoroutine()
		if base["engines"] != 0 || base["actors"] == 0 || intakeHolds(base) {
			return fmt.Errorf("warm-up not settled: %v", base)
		}
		return nil
	})
	t.Logf("baseline after warm-up: %d goroutines, %v", goroutines, base)
	pool := func() int { st := e.node.Store().Stats(); return st.Pinned + st.Pending }
	require.Zero(t, pool(), "pins or pending copies after the warm-up")

	for i := 0; i < cycles; i++ {
		cycle(churnEnds[i%len(churnEnds)])
	}
	settled(base, goroutines)
	require.Zero(t, pool(), "pins or pending copies left by the churn")
	t.Logf("after %d cycles: %d goroutines, %v", cycles, runtime.NumGoroutine(), e.node.Footprint())
}

// intakeHolds: a footprint's intake holds bytes (a message not yet
// handled), in total or in a bucket; a baseline waits for none, so that
// every byte later held shows as a leak.
func intakeHolds(f map[string]int) bool {
	return f["ingest_pending_bytes"] != 0 || f["ingest_bucket_bytes"] != 0 || f["ingest_buckets_held"] != 0
}

// footprintDiffs names the counts of now (a Footprint, or any map of
// counts) that differ from base: each must be back to its baseline,
// except what is kept per engine id for the boot (departed.go,
// isolation.go, cluster_dropped.go), which may grow by one per fresh id
// (ids of them). who prefixes each (a node's name).
func footprintDiffs(who string, base, now map[string]int, ids int) []string {
	var diffs []string
	for k, v := range now {
		switch k {
		case "cleared", "releases", "epochs", "departed", "ns_opened", "namespaces", "cluster_dropped":
			if v > base[k]+ids {
				diffs = append(diffs, fmt.Sprintf("%s%s %d, baseline %d + %d ids", who, k, v, base[k], ids))
			}
		default:
			if v != base[k] {
				diffs = append(diffs, fmt.Sprintf("%s%s %d, baseline %d", who, k, v, base[k]))
			}
		}
	}
	return diffs
}

// segmentMappings counts this process's mappings of files under dir (the
// engines' shm segments: the node maps them in the test's process).
func segmentMappings(t *testing.T, dir string) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	return strings.Count(string(maps), dir+"/")
}

// The same on a cluster: engines under fresh ids in fresh namespaces on
// two nodes store on one and load on the other (a remote fetch, bytes
// compared), then leave; then a third node joins and closes. Each node's
// per-engine maps, claims and dropped ids go back to the baseline, and the
// holder index forgets the node that left (after a lease).
func TestEngineChurnOnAClusterLeavesNothingBehind(t *testing.T) {
	cycles := 2
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_CHURN_CYCLES")); err == nil && v > 0 {
		cycles = v
	}
	kc := startCluster(t, 2)
	n := 0
	cycle := func() {
		t.Helper()
		n++
		ns := fmt.Sprintf("ns%d", n)
		a := kc.engineOn(0, fmt.Sprintf("ca%d", n), ns)
		b := kc.engineOn(1, fmt.Sprintf("cb%d", n), ns)
		a.register()
		b.register()
		b.keepAlive(clusterLease / 8)
		hs := []string{hash(ns, 0), hash(ns, 1)}
		a.storePrefix("r", hs, 1, 2, byte(n), ns+" stored on n0")
		awaitLookup(t, b, hs, 8, "n1")
		r := b.loadInto("l", hs, 8, []int{5, 6})
		require.True(t, r.OK, r.Error)
		require.Equal(t, 2, r.RemoteChunks)
		for i := range 2 {
			require.True(t, bytes.Equal(a.block(0, messages.BlockID(1+i)), b.block(0, messages.BlockID(5+i))))
		}
		for _, te := range []*testEngine{a, b} {
			te.unregister()
			for _, w := range te.subs {
				require.NoError(t, w.sub.Unsubscribe())
			}
			require.NoError(t, te.seg.Remove())
		}
	}
	foot := func() []map[string]int {
		return []map[string]int{kc.nodes[0].node.Footprint(), kc.nodes[1].node.Footprint()}
	}
	settled := func(base []map[string]int) error {
		var diffs []string
		for i, now := range foot() {
			diffs = append(diffs, footprintDiffs(fmt.Sprintf("n%d ", i), base[i], now, cycles)...)
		}
		if len(diffs) > 0 {
			return fmt.Errorf("%s", strings.Join(diffs, "; "))
		}
		return nil
	}
	cycle() // warm-up
	var base []map[string]int
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error {
		base = foot()
		for i, f := range base {
			if f["engines"] != 0 || f["cluster_mine"] != 0 || f["cluster_peers"] != 1 || intakeHolds(f) {
				return fmt.Errorf("warm-up not settled on n%d: %v", i, f)
			}
		}
		return nil
	})
	t.Logf("baseline after warm-up: %v", base)
	for range cycles {
		cycle()
	}
	// A node joins, is heard, and leaves: the others forget it a lease on.
	p := kc.startNode(2, "p")
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error {
		for i, f := range foot() {
			if f["cluster_peers"] != 2 {
				return fmt.Errorf("n%d hears %d other nodes", i, f["cluster_peers"])
			}
		}
		return nil
	})
	require.NoError(t, p.node.Close(context.Background()))
	testkit.Eventually(t, 10*time.Second, 20*time.Millisecond, func() error { return settled(base) })
	t.Logf("after %d cycles: %v", cycles, foot())
}
