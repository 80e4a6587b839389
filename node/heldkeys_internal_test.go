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
	for round := range 50 {
		for range r.IntN(60) {
			i, ns := r.IntN(2000), fmt.Sprintf("ns%d", r.IntN(3))
			nk := holders.NSKey{NS: ns, Key: sched.WireKey(pool(i))}
			if r.IntN(3) > 0 {
				h.observe(messages.KVBlockStored, messages.MediumCPU, ns, []messages.Key{pool(i)})
				set[nk] = true
			} else {
				h.observe(messages.KVBlockRemoved, messages.MediumCPU, ns, []messages.Key{pool(i)})
				delete(set, nk)
			}
		}
		var want []holders.NSKey
		for k := range set {
			want = append(want, k)
		}
		want = cluster.NewSortedKeys(want)
		got := all(1 + r.IntN(100))
		require.True(t, slices.Equal(want, got), "round %d: %d keys paged, want %d", round, len(got), len(want))
	}
	require.Greater(t, len(set), 500)
	require.Zero(t, testing.AllocsPerRun(10, func() { h.KeysAfter(holders.NSKey{}, 64) }), "a page of an unchanged set")
}
