package hostpool

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// A pool holds at most its chunk cap, whatever its bytes allow: an
// engine's one-byte chunks would otherwise fill a pool's bytes with a
// billion entries, each ~170 bytes of heap. A store past the cap evicts
// the least recently used ready chunks as one past the bytes does (their
// keys in Evicted), never a pinned, pending or offered one, and one that
// cannot be given room is refused and changes nothing.
func TestTheChunkCapEvictsAsTheBytesDo(t *testing.T) {
	p := New(1<<20, 4096) // a million one-byte chunks' bytes
	p.SetMaxChunks(3)
	one := func(keys ...messages.Key) []int64 {
		s := make([]int64, len(keys))
		for i := range s {
			s[i] = 1
		}
		return s
	}
	store := func(keys ...messages.Key) (Prepared, error) {
		t.Helper()
		prep, err := p.PrepareStore(keys, one(keys...))
		checkInvariants(t, p)
		require.LessOrEqual(t, p.Len(), 3)
		return prep, err
	}
	refused := func(keys ...messages.Key) {
		t.Helper()
		before := snapshot(p)
		prep, err := store(keys...)
		require.ErrorIs(t, err, ErrNoRoom)
		require.Empty(t, prep.Keys)
		require.Empty(t, prep.Evicted)
		require.Equal(t, before, snapshot(p), "no room changes nothing")
	}

	prep, err := store("a", "b", "c")
	require.NoError(t, err)
	require.Empty(t, prep.Evicted)
	p.CompleteStore(prep.Keys, make([]uint32, 3))
	require.NoError(t, p.PrepareLoad([]messages.Key{"a"})) // pinned

	prep, err = store("d")
	require.NoError(t, err)
	require.Equal(t, []messages.Key{"b"}, prep.Evicted, "the LRU unpinned ready chunk goes")
	require.Equal(t, 3, p.Stats().Used)

	refused("e", "c") // a pinned, c offered, d pending: nothing to evict
	prep, err = store("e")
	require.NoError(t, err)
	require.Equal(t, []messages.Key{"c"}, prep.Evicted)
	refused("f") // a pinned, d and e pending

	p.CompleteLoad([]messages.Key{"a"})
	prep, err = store("f")
	require.NoError(t, err)
	require.Equal(t, []messages.Key{"a"}, prep.Evicted)
	require.Equal(t, 3, p.Stats().MaxChunks)

	// More new chunks than the cap: never held, refused at once.
	q := New(1<<20, 4096)
	q.SetMaxChunks(3)
	_, err = q.PrepareStore([]messages.Key{"a", "b", "c", "d"}, one("a", "b", "c", "d"))
	require.ErrorIs(t, err, ErrNoRoom)
	require.Zero(t, q.Len())
	require.False(t, q.HoldsEmpty([]int64{1, 2}, []int64{2, 2}), "4 chunks in a pool of 3")
	require.True(t, q.HoldsEmpty([]int64{1, 2}, []int64{2, 1}))
}

// A shared pool at its cap with nothing evictable is full (the fast
// refusal), and stops being full once a chunk can go.
func TestASharedPoolAtItsCapIsFull(t *testing.T) {
	s := NewShared(1<<20, 4096)
	s.SetMaxChunks(2)
	prep, err := s.PrepareStore([]messages.Key{"a", "b"}, []int64{1, 1})
	require.NoError(t, err)
	require.True(t, s.full.Load(), "two pending chunks in a pool of two")
	_, err = s.PrepareStore([]messages.Key{"c"}, []int64{1})
	require.ErrorIs(t, err, ErrNoRoom)
	s.CompleteStore(prep.Keys, []uint32{0, 0})
	require.False(t, s.full.Load())
	prep, err = s.PrepareStore([]messages.Key{"c"}, []int64{1})
	require.NoError(t, err)
	require.Equal(t, []messages.Key{"a"}, prep.Evicted)
}

// DefaultMaxChunks: one chunk per 4 KiB of pool, at least 65536 (a small
// test pool of small chunks is not capped below its pages), at most
// MaxChunks (entries are numbered in int32).
func TestDefaultMaxChunks(t *testing.T) {
	require.Equal(t, 65536, DefaultMaxChunks(16<<20))
	require.Equal(t, 262144, DefaultMaxChunks(1<<30))
	require.Equal(t, MaxChunks, DefaultMaxChunks(1<<50))
}
