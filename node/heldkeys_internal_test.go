package node

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/cluster/holders"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// The cluster's key set follows the host pool's announcements only: a
// chunk stored and removed in CPU comes and goes, under the key that
// holders.KeyOf makes of its hash and group (what fetches look up), and
// the disk tier's announcements change nothing (fetches are served from
// host memory).
func TestHeldKeysFollowHostMemoryOnly(t *testing.T) {
	h := newHeldKeys()
	pool := func(hash string, group int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(hash), group))
	}
	wire := func(hash string, group int) messages.Key { return holders.KeyOf([]byte(hash), group) }

	h.observe(messages.KVBlockStored, messages.MediumCPU, "m", []messages.Key{pool("a", 0), pool("b", 1)})
	require.True(t, h.has("m", wire("a", 0)))
	require.True(t, h.has("m", wire("b", 1)))
	require.False(t, h.has("other", wire("a", 0)), "another namespace's name")
	require.False(t, h.has("m", wire("a", 1)), "another group")

	h.observe(messages.KVBlockStored, messages.MediumDisk, "m", []messages.Key{pool("d", 0)})
	require.False(t, h.has("m", wire("d", 0)), "spilled to disk is not held in memory")
	h.observe(messages.KVBlockRemoved, messages.MediumCPU, "m", []messages.Key{pool("a", 0)})
	require.False(t, h.has("m", wire("a", 0)))
	h.observe(messages.KVBlockRemoved, messages.MediumDisk, "m", []messages.Key{pool("b", 1)})
	require.True(t, h.has("m", wire("b", 1)), "a disk removal does not drop a chunk held in memory")
}

// Pages of the key set follow every change, in (namespace, key) order,
// each key once; a page of a set unchanged since the last costs a search,
// not a copy and sort of the whole set (which made a catch-up quadratic in
// the set's size).
func TestHeldKeysPageTheCurrentSetInOrderAndCopyNothingWhenUnchanged(t *testing.T) {
	h := newHeldKeys()
	r := rand.New(rand.NewPCG(3, 4))
	pool := func(i int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(fmt.Sprintf("h%04d", i)), i%2))
	}
	set := map[holders.NSKey]bool{}
	all := func(pageSize int) []holders.NSKey {
		var out []holders.NSKey
		var after holders.NSKey
		for {
			page := h.KeysAfter(after, pageSize)
			out = append(out, page...)
			if len(page) < pageSize {
				return out
			}
			after = page[len(page)-1]
		}
	}
	rebuilt := 0
	for round := range 50 {
		for range 1 + r.IntN(60) {
			i, ns := r.IntN(2000), fmt.Sprintf("ns%d", r.IntN(3))
			nk := holders.NSKey{NS: ns, Key: sched.WireKey(pool(i))}
			if r.IntN(3) > 0 {
				h.observe(messages.KVBlockStored, messages.MediumCPU, ns, []messages.Key{pool(i)})
				set[nk] = true
			} else {
				h.observe(messages.KVBlockRemoved, messages.MediumCPU, ns, []messages.Key{pool(i)})
				delete(set, nk)
			}
			if round%7 == 6 {
				// Keys stored and evicted between two pages, more than
				// the set plus heldKeysChangesSlack all told: the changes
				// are dropped, and the next page sorts the set afresh.
				for range (2*len(set) + 2*heldKeysChangesSlack) / 30 {
					j := 10000 + r.IntN(1_000_000)
					h.observe(messages.KVBlockStored, messages.MediumCPU, ns, []messages.Key{pool(j)})
					h.observe(messages.KVBlockRemoved, messages.MediumCPU, ns, []messages.Key{pool(j)})
				}
			}
		}
		h.mu.Lock()
		if h.stale {
			rebuilt++
		}
		require.LessOrEqual(t, len(h.changes), h.n+heldKeysChangesSlack, "round %d", round)
		h.mu.Unlock()
		var want []holders.NSKey
		for k := range set {
			want = append(want, k)
		}
		want = cluster.NewSortedKeys(want)
		got := all(1 + r.IntN(100))
		require.True(t, slices.Equal(want, got), "round %d: %d keys paged, want %d", round, len(got), len(want))
	}
	require.Greater(t, len(set), 500)
	require.Greater(t, rebuilt, 3, "rounds whose page sorted the set afresh")
	require.Zero(t, testing.AllocsPerRun(10, func() { h.KeysAfter(holders.NSKey{}, 64) }), "a page of an unchanged set")
}

// The changes kept for the next page are bounded by the set, not by every
// key stored since the last page: in a steady cluster nobody pages a
// node's set, and each chunk stored and evicted kept ~150 bytes for good.
func TestHeldKeysChangesAreBoundedWithoutPages(t *testing.T) {
	h := newHeldKeys()
	const held, churn = 100, 200000
	pool := func(i int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(fmt.Sprintf("hash-%08d", i)), 0))
	}
	for i := range churn {
		h.observe(messages.KVBlockStored, messages.MediumCPU, "m", []messages.Key{pool(i)})
		if i >= held {
			h.observe(messages.KVBlockRemoved, messages.MediumCPU, "m", []messages.Key{pool(i - held)})
		}
	}
	h.mu.Lock()
	require.Equal(t, held, h.n)
	require.LessOrEqual(t, len(h.changes), 4*held+1024,
		"changes kept for %d keys held: every key ever stored and removed since the last page", h.n)
	require.LessOrEqual(t, len(h.sorted), 4*held+1024)
	h.mu.Unlock()

	// The next page has every key held, once, in order.
	var want []holders.NSKey
	for i := churn - held; i < churn; i++ {
		want = append(want, holders.NSKey{NS: "m", Key: sched.WireKey(pool(i))})
	}
	want = cluster.NewSortedKeys(want)
	require.Equal(t, want, []holders.NSKey(h.KeysAfter(holders.NSKey{}, 2*held)))
	require.Equal(t, want[50:], []holders.NSKey(h.KeysAfter(want[49], 2*held)))
}

// A page served while the journal observes changes touches the live
// changes map only under the lock, also when it was empty (go test -race).
func TestHeldKeysPagesWhileTheJournalObserves(t *testing.T) {
	h := newHeldKeys()
	key := func(i int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(fmt.Sprintf("hash-%08d", i)), 0))
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 2000 {
			h.observe(messages.KVBlockStored, messages.MediumCPU, "m", []messages.Key{key(i)})
		}
	}()
	for {
		_ = h.KeysAfter(holders.NSKey{}, 16)
		select {
		case <-done:
			require.Len(t, h.KeysAfter(holders.NSKey{}, 4096), 2000)
			return
		default:
		}
	}
}

// An AllBlocksCleared (the node forgot the namespace) drops that
// namespace's keys only, in host memory only, and the next page follows:
// whether the page merges the changes or sorts the set afresh (changes
// dropped for their number).
func TestHeldKeysClearDropsOneNamespace(t *testing.T) {
	pool := func(i int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(fmt.Sprintf("hash-%08d", i)), i%2))
	}
	keys := func(from, to int) []messages.Key {
		var out []messages.Key
		for i := from; i < to; i++ {
			out = append(out, pool(i))
		}
		return out
	}
	want := func(ns string, from, to int) []holders.NSKey {
		var out []holders.NSKey
		for _, k := range keys(from, to) {
			out = append(out, holders.NSKey{NS: ns, Key: sched.WireKey(k)})
		}
		return out
	}
	for _, stale := range []bool{false, true} {
		h := newHeldKeys()
		h.observe(messages.KVBlockStored, messages.MediumCPU, "a", keys(0, 10))
		h.observe(messages.KVBlockStored, messages.MediumCPU, "m", keys(0, 20))
		h.observe(messages.KVBlockStored, messages.MediumCPU, "z", keys(5, 15))
		require.Len(t, h.KeysAfter(holders.NSKey{}, 100), 40)

		h.observe(messages.KVAllBlocksCleared, messages.MediumDisk, "m", nil)
		require.True(t, h.has("m", sched.WireKey(pool(3))), "the disk tier's clear leaves host memory's keys")
		h.observe(messages.KVAllBlocksCleared, messages.MediumCPU, "unknown", nil)
		if stale {
			for i := range 2*40 + heldKeysChangesSlack { // keys stored and evicted: the changes are dropped
				h.observe(messages.KVBlockStored, messages.MediumCPU, "a", []messages.Key{pool(1000 + i)})
				h.observe(messages.KVBlockRemoved, messages.MediumCPU, "a", []messages.Key{pool(1000 + i)})
			}
			h.mu.Lock()
			require.True(t, h.stale)
			h.mu.Unlock()
		}
		h.observe(messages.KVAllBlocksCleared, messages.MediumCPU, "m", nil)
		for i := range 20 {
			require.False(t, h.has("m", sched.WireKey(pool(i))), "stale %v: m's key %d", stale, i)
		}
		require.True(t, h.has("a", sched.WireKey(pool(3))))
		require.True(t, h.has("z", sched.WireKey(pool(14))))
		require.Equal(t, []holders.NSKey(cluster.NewSortedKeys(append(want("a", 0, 10), want("z", 5, 15)...))),
			h.KeysAfter(holders.NSKey{}, 100), "stale %v", stale)

		// The namespace's keys come back when stored again.
		h.observe(messages.KVBlockStored, messages.MediumCPU, "m", keys(0, 2))
		require.True(t, h.has("m", sched.WireKey(pool(1))))
		require.Len(t, h.KeysAfter(holders.NSKey{}, 100), 22, "stale %v", stale)
		h.mu.Lock()
		require.Equal(t, 22, h.n)
		h.mu.Unlock()
	}
}

// Clearing a namespace (a forgotten one's AllBlocksCleared: once per
// fresh-id register under engine churn with a full namespace table) costs
// that namespace's keys, whatever other namespaces hold.
func BenchmarkHeldKeysClearOneNamespace(b *testing.B) {
	pool := func(i int) messages.Key {
		return messages.Key(sched.AppendKey(nil, 3, messages.Hash(fmt.Sprintf("hash-%08d", i)), 0))
	}
	own := []messages.Key{pool(0), pool(1), pool(2), pool(3), pool(4), pool(5), pool(6), pool(7)}
	for _, others := range []int{0, 10_000, 100_000} {
		b.Run(fmt.Sprintf("others=%d", others), func(b *testing.B) {
			h := newHeldKeys()
			for i := range others {
				h.observe(messages.KVBlockStored, messages.MediumCPU, fmt.Sprintf("ns%d", i%64), []messages.Key{pool(i)})
			}
			h.KeysAfter(holders.NSKey{}, 1) // the setup's changes merged: the loop's own are all there are
			for b.Loop() {
				h.observe(messages.KVBlockStored, messages.MediumCPU, "m", own)
				h.observe(messages.KVAllBlocksCleared, messages.MediumCPU, "m", nil)
			}
		})
	}
}
