package node_test

import (
	"bytes"
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
			var un messages.UnregisterReply
			require.NoError(t, jsonUnmarshal(te.request("unregister", map[string]any{}), &un))
			require.True(t, un.OK, un.Error)
			require.Equal(t, live, un.Released, "%s: requests live at the unregister", id)
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
			now := e.node.Footprint()
			for k, v := range now {
				switch k {
				case "cleared", "releases", "epochs", "departed", "ns_opened", "namespaces":
					// kept per id for the boot (bounded: departed.go, isolation.go)
					if v > base[k]+cycles {
						diffs = append(diffs, fmt.Sprintf("%s %d, baseline %d + %d ids", k, v, base[k], cycles))
					}
				default:
					if v != base[k] {
						diffs = append(diffs, fmt.Sprintf("%s %d, baseline %d", k, v, base[k]))
					}
				}
			}
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
		if base["engines"] != 0 || base["actors"] == 0 {
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

// segmentMappings counts this process's mappings of files under dir (the
// engines' shm segments: the node maps them in the test's process).
func segmentMappings(t *testing.T, dir string) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	require.NoError(t, err)
	return strings.Count(string(maps), dir+"/")
}
