package hostpool

import (
	"fmt"
	"math/rand"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// checkIndex: the index holds each entry once, under its key's tag, at most
// half full, and every slot is reachable from its home (no empty slot
// between them), which is what lets get stop at the first empty slot.
func checkIndex(t *testing.T, x *keyIndex, entries []entry) {
	t.Helper()
	mask := len(x.slots) - 1
	seen := map[ref]bool{}
	for i, s := range x.slots {
		if s == 0 {
			continue
		}
		r := slotRef(s)
		require.False(t, seen[r], "entry %d indexed twice", r)
		seen[r] = true
		require.Less(t, int(r), len(entries), "slot %d: ref out of range", i)
		k := entries[r].key
		require.Equal(t, x.tag(k), slotTag(s), "slot %d: tag is not its key's", i)
		require.Equal(t, entries[r].tag, slotTag(s), "slot %d: tag is not the one its entry keeps", i)
		for j := x.home(slotTag(s)); j != i; j = (j + 1) & mask {
			require.NotZero(t, x.slots[j], "slot %d is past an empty slot of its run (home %d)", i, x.home(slotTag(s)))
		}
		got, ok := x.get(k, entries)
		require.True(t, ok && got == r, "get(%x) = %d,%v, want %d", string(k), got, ok, r)
	}
	require.Len(t, seen, x.n, "count")
	require.LessOrEqual(t, 2*x.n, len(x.slots), "more than half full")
}

// The index against a map, under random puts and deletes of few keys in a
// small table: runs collide, wrap past the table's end and get shifted back
// by deletes.
func TestKeyIndexMatchesAMap(t *testing.T) {
	f := func(seed int64, ops []uint16) bool {
		rng := rand.New(rand.NewSource(seed))
		x := newKeyIndex(0)
		var entries []entry
		var free []ref
		model := map[messages.Key]ref{}
		for _, op := range ops {
			k := messages.Key(fmt.Sprintf("k%d", op%64))
			r, ok := model[k]
			got, found := x.get(k, entries)
			if found != ok || found && got != r {
				t.Logf("get(%s) = %d,%v, model %d,%v", k, got, found, r, ok)
				return false
			}
			switch {
			case ok && rng.Intn(2) == 0:
				x.del(entries[r].tag, r)
				delete(model, k)
				entries[r].key = ""
				free = append(free, r)
			case !ok:
				if n := len(free); n > 0 {
					r, free = free[n-1], free[:n-1]
				} else {
					r = ref(len(entries))
					entries = append(entries, entry{})
				}
				entries[r].key = k
				entries[r].tag = x.tag(k)
				x.put(entries[r].tag, r)
				model[k] = r
			}
			checkIndex(t, &x, entries)
		}
		return x.n == len(model)
	}
	require.NoError(t, quick.Check(f, &quick.Config{MaxCount: 300}))
}

// Keys that share a home slot, the last one so their run wraps past the
// table's end, mixed with keys homed just after it, deleted in every
// rotation of their order: each delete must shift the rest of the run back,
// or a later get stops short at the hole.
func TestKeyIndexDeletesInsideAWrappingRun(t *testing.T) {
	seed := newKeyIndex(0)
	last := len(seed.slots) - 1
	var keys []messages.Key
	for i, atLast, atFirst := 0, 0, 0; atLast < 4 || atFirst < 3; i++ {
		k := messages.Key(fmt.Sprintf("key-%d", i))
		switch h := seed.home(seed.tag(k)); {
		case h == last && atLast < 4:
			atLast++
			keys = append(keys, k)
		case h == 0 && atFirst < 3:
			atFirst++
			keys = append(keys, k)
		}
	}
	entries := make([]entry, len(keys))
	for i, k := range keys {
		entries[i].key = k
	}
	for rot := range keys {
		x := keyIndex{seed: seed.seed, slots: make([]uint64, len(seed.slots))}
		for i, k := range keys {
			entries[i].tag = x.tag(k)
			x.put(entries[i].tag, ref(i))
		}
		checkIndex(t, &x, entries)
		for n := range keys {
			i := (rot + n) % len(keys)
			x.del(entries[i].tag, ref(i))
			_, ok := x.get(keys[i], entries)
			require.False(t, ok, "rotation %d: deleted key %d still found", rot, i)
			checkIndex(t, &x, entries)
		}
		require.Zero(t, x.n)
	}
}

// Growing keeps every key: the table doubles at half full and places slots
// by their tags alone.
func TestKeyIndexGrows(t *testing.T) {
	x := newKeyIndex(0)
	var entries []entry
	for i := range 5000 {
		k := messages.Key(fmt.Sprintf("grow-%d", i))
		entries = append(entries, entry{key: k})
		entries[i].tag = x.tag(k)
		x.put(entries[i].tag, ref(i))
	}
	checkIndex(t, &x, entries)
	require.Equal(t, 16384, len(x.slots), "5,000 keys at most half full")
	x.reserve(100)
	require.Equal(t, 16384, len(x.slots), "reserve never shrinks")
}

// Two keys whose tags are equal (found by a birthday search over two
// namespaces' keys) are two chunks: a probe that matched the tag alone
// would answer one key's lookup, load or store with the other's chunk,
// another namespace's KV perhaps (docs/SECURITY.md).
func TestKeysSharingATagAreDistinct(t *testing.T) {
	p := New(4, 1)
	byTag := map[uint32]messages.Key{}
	var a, b messages.Key
	for i := 0; a == ""; i++ {
		k := messages.Key(fmt.Sprintf("ns%d/chunk-%d", i%2, i))
		if other, ok := byTag[p.index.tag(k)]; ok {
			a, b = other, k
		}
		byTag[p.index.tag(k)] = k
	}
	require.Equal(t, p.index.tag(a), p.index.tag(b))

	prep, err := p.PrepareStore([]messages.Key{a}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{a}, prep.Keys)
	p.CompleteStore(prep.Keys, []uint32{1})
	st, _ := p.Lookup(b)
	require.Equal(t, Absent, st, "%x hits %x's chunk", string(b), string(a))
	require.ErrorIs(t, p.PrepareLoad([]messages.Key{b}), ErrNotReady)

	prep, err = p.PrepareStore([]messages.Key{b}, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{b}, prep.Keys, "stored as a chunk of its own")
	p.CompleteStore(prep.Keys, []uint32{2})
	require.True(t, p.Drop(b, 2))
	st, _ = p.Lookup(a)
	require.Equal(t, Ready, st, "dropping %x took %x", string(b), string(a))
	checkInvariants(t, p)
}
