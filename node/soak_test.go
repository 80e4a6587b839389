package node_test

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
)

// soakHeapSlack is how many heap objects (after a GC) the soak lets the
// node gain after its warm-up, whatever the cycles: buffers and pools
// moved by about a hundred either way over 20 to 1000 cycles once the
// actor registry was primed; a map entry left per resync (1.6 objects a
// cycle) passed it by 200 cycles.
const soakHeapSlack = 250

// A node runs for weeks with the same two engines registered while
// requests flow through it: every cycle each engine stores a prefix under
// fresh request ids (a pool of 8 chunks, so every store evicts, and the
// evicted chunks spill to a disk tier of 16 chunks, which drops its
// oldest), loads it back and loads the previous cycle's (read back from
// disk when evicted), bytes compared, aborts a request, sends a heartbeat
// and lets time pass (a fake liveness clock: a quarter of the lease a
// cycle, renewed each time); the second engine also loses a batch every
// cycle, resyncs into a new epoch and re-announces its live request.
// Nothing the node keeps may grow with the requests or with time: the
// per-engine maps (Footprint), what requests and copies leave (pins,
// waiters, kept release counts, epochs, journal records:
// RequestFootprint), goroutines, actors, the server's subscriptions, the
// metric series, the engines' live requests and idle actors, and the heap
// (objects after a GC, within soakHeapSlack) come back to their level
// after a warm-up; the disk stays within its budget.
// KVACTORS_SOAK_CYCLES sets the cycles (20).
func TestStableEnginesUnderManyRequestsKeepNothingPerRequest(t *testing.T) {
	cycles := 20
	if v, err := strconv.Atoi(os.Getenv("KVACTORS_SOAK_CYCLES")); err == nil && v > 0 {
		cycles = v
	}
	const lease = 10 * time.Second
	const diskBudget = 16 * 256
	var offset atomic.Int64 // the liveness clock's lead: time passing without waiting for it
	e := startNode(t, withPoolSlots(8), withDisk(t.TempDir()),
		func(c *node.Config) { c.Lease, c.DiskBytes = lease, diskBudget },
		node.WithClock(func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }))
	a, b := e.newEngine("soaka", defaultOpts()), e.newEngine("soakb", defaultOpts())
	b.rseqKeep.Store(4) // its epochs' releases end within a cycle
	a.register()
	b.register()
	engines := []*testEngine{a, b}
	type prefix struct {
		hs   []string
		want []byte
	}
	prev := map[*testEngine]prefix{}

	n, missed := 0, 0
	cycle := func() {
		t.Helper()
		n++
		for _, te := range engines {
			id := fmt.Sprintf("%s.%d", te.id, n)
			// Store a prefix of two chunks (blocks 1, 2).
			hs := []string{soakHash(te.id, 2*n), soakHash(te.id, 2*n+1)}
			te.fill(0, 1, byte(n))
			te.fill(0, 2, byte(n))
			want := append(bytes.Clone(te.block(0, 1)), te.block(0, 2)...)
			s := "s" + id
			te.send(added(s, 8), hashesEv(s, 0, hs...), blocksEv(s, 0, 0, 1, 2), tokensEv(s, 8, 8),
				finishedEv(s, false, 8, 8))
			recv(t, te.stored, s+" stored")
			require.Equal(t, messages.ReasonFinished, recv(t, te.released, s+" released").Reason)
			// Load it back, and the previous cycle's prefix (evicted by now,
			// perhaps: from disk), bytes compared.
			soakLoad(t, te, "l"+id, hs, want, 10, true)
			if p, ok := prev[te]; ok && !soakLoad(t, te, "o"+id, p.hs, p.want, 20, false) {
				missed++
			}
			prev[te] = prefix{hs, want}
			// An abort: a request with nothing to store yet, aborted.
			ab := "a" + id
			te.send(added(ab, 8), hashesEv(ab, 0, soakHash(te.id+"x", n), soakHash(te.id+"y", n)),
				blocksEv(ab, 0, 0, 3, 4), tokensEv(ab, 0, 8), finishedEv(ab, true, 0, 8))
			require.Equal(t, messages.ReasonAborted, recv(t, te.released, ab+" released").Reason)
			if te == b {
				// A batch lost with a request live: a resync, a new epoch,
				// the request re-announced in it, then finished.
				r := "r" + id
				ev := []map[string]any{added(r, 8), blocksEv(r, 0, 0, 5, 6)}
				te.send(ev...)
				te.seq++
				te.send(added("lost"+id, 4))
				recv(t, te.resync, id+" resync")
				te.epoch, te.seq = fmt.Sprintf("ep%d", n+1), 0
				te.send(append(ev, finishedEv(r, false, 0, 8))...)
				require.Equal(t, messages.ReasonEngineReset, recv(t, te.released, r+" reset").Reason)
				require.Equal(t, messages.ReasonFinished, recv(t, te.released, r+" released").Reason)
			}
		}
		// Time passes, and each engine renews its lease.
		offset.Add(int64(lease / 4))
		for _, te := range engines {
			hb := te.heartbeat(te.epoch, te.seq)
			require.Empty(t, hb.Error, "%s: heartbeat", te.id)
			require.Equal(t, te.epoch, hb.Epoch)
			drain(te.kv)
		}
	}

	measure := func() map[string]int {
		m := map[string]int{"goroutines": runtime.NumGoroutine(), "segment_mappings": segmentMappings(t, e.dir)}
		for k, v := range e.node.Footprint() {
			m[k] = v
		}
		for k, v := range e.node.RequestFootprint() {
			m[k] = v
		}
		for k, v := range seriesPerFamily(t, e.reg) {
			m["series "+k] = v
		}
		for _, te := range engines {
			st := te.sync()
			m[te.id+" live_requests"] = len(st.Requests)
			m[te.id+" idle_actors"] = st.IdleActors
		}
		return m
	}
	heap := func() uint64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.GC() // the first frees what sync.Pools held
		runtime.ReadMemStats(&ms)
		return ms.HeapObjects
	}

	settledAt := func(want map[string]int) error {
		now := measure()
		var diffs []string
		for k, v := range now {
			switch {
			case k == "goroutines":
				if v > want[k]+3 {
					diffs = append(diffs, fmt.Sprintf("goroutines %d, baseline %d", v, want[k]))
				}
			case strings.HasSuffix(k, "idle_actors"):
				if v > want[k]+2 { // the released actors kept: those of one cycle
					diffs = append(diffs, fmt.Sprintf("%s %d, baseline %d", k, v, want[k]))
				}
			default:
				if v != want[k] {
					diffs = append(diffs, fmt.Sprintf("%s %d, baseline %d", k, v, want[k]))
				}
			}
		}
		for k := range want {
			if _, ok := now[k]; !ok {
				diffs = append(diffs, fmt.Sprintf("%s gone, baseline %d", k, want[k]))
			}
		}
		if len(diffs) > 0 {
			sort.Strings(diffs)
			return fmt.Errorf("%s", strings.Join(diffs, "; "))
		}
		return nil
	}

	// Warm-up: until the disk drops its oldest, so both tiers churn.
	for e.node.Disk().Stats().Evictions == 0 || n < 3 {
		cycle()
	}
	warm := n
	e.node.PrimeActorRegistry()
	var base map[string]int
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error {
		base = measure()
		f := e.node.RequestFootprint()
		if f["pool_pinned"]+f["pool_pending"]+f["kv_recs"] != 0 || intakeHolds(f) {
			return fmt.Errorf("warm-up not settled: %v", f)
		}
		return nil
	})
	baseHeap := heap()
	t.Logf("baseline after %d warm-up cycles: %d heap objects, %s", warm, baseHeap, brief(base))

	start := time.Now()
	for range cycles {
		cycle()
	}
	testkit.Eventually(t, 5*time.Second, 10*time.Millisecond, func() error { return settledAt(base) })
	require.Equal(t, 2, len(e.node.Engines()), "both engines stayed registered")
	ds := e.node.Disk().Stats()
	require.LessOrEqual(t, ds.Bytes, int64(diskBudget), "disk data within its budget")
	require.Positive(t, ds.Hits, "the previous cycle's prefix was read back from disk")
	require.Less(t, missed, n/4, "the previous cycle's prefix dropped from disk")
	var now uint64
	testkit.Eventually(t, 5*time.Second, 50*time.Millisecond, func() error {
		if now = heap(); now > baseHeap+soakHeapSlack {
			return fmt.Errorf("%d heap objects, baseline %d + %d", now, baseHeap, soakHeapSlack)
		}
		return nil
	})
	t.Logf("after %d cycles (%v): %d heap objects (baseline %d), %d previous prefixes dropped from disk, disk %+v",
		cycles, time.Since(start), now, baseHeap, missed, ds)
}

// soakHash is block i's hash in family f (8 bytes; i below a million).
func soakHash(f string, i int) string {
	return hex.EncodeToString([]byte(fmt.Sprintf("%-2.2s%06d", strings.TrimPrefix(f, "soak"), i)))
}

// soakLoad loads hs (two chunks) into blocks at and at+1 and compares them
// with want. A prefix evicted may still be on its way to disk: its load
// waits for the disk's queue to empty. Unless must, a prefix the disk
// dropped since (its budget, or its oldest segment deleted with the live
// chunks in it: disk.dropDead) is not loaded; it reports whether it was.
func soakLoad(t *testing.T, te *testEngine, req string, hs []string, want []byte, at int, must bool) bool {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		if q := te.e.node.Disk().Stats().Queued; q > 0 {
			return fmt.Errorf("%s: %d bytes queued for the disk", req, q)
		}
		return nil
	})
	if got := te.lookup(hs); got != 8 {
		require.False(t, must, "%s: lookup %d tokens; pool %+v; disk %+v", req, got, te.e.node.Store().Stats(),
			te.e.node.Disk().Stats())
		return false
	}
	te.fill(0, messages.BlockID(at), 0)
	te.fill(0, messages.BlockID(at+1), 0)
	r := te.loadInto(req, hs, 8, []int{at, at + 1})
	require.True(t, r.OK, "%s: %s", req, r.Error)
	got := append(bytes.Clone(te.block(0, messages.BlockID(at))), te.block(0, messages.BlockID(at+1))...)
	require.True(t, bytes.Equal(want, got), "%s: loaded bytes differ", req)
	return true
}

// brief is m without its metric series (one line per family), and their
// total.
func brief(m map[string]int) string {
	out, series := map[string]int{}, 0
	for k, v := range m {
		if strings.HasPrefix(k, "series ") {
			series += v
		} else {
			out[k] = v
		}
	}
	return fmt.Sprintf("%v, %d metric series", out, series)
}

// drain empties ch without waiting.
func drain[T any](ch <-chan T) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

// seriesPerFamily counts each metric family's series in reg.
func seriesPerFamily(t *testing.T, reg prometheus.Gatherer) map[string]int {
	t.Helper()
	mfs, err := reg.Gather()
	require.NoError(t, err)
	out := map[string]int{}
	for _, mf := range mfs {
		out[mf.GetName()] = len(mf.GetMetric())
	}
	return out
}
