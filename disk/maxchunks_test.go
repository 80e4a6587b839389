package disk

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// The tier holds at most MaxChunks chunks whatever their size: each costs
// its index ~190 bytes of the node's memory, and an engine's spec may make
// chunks of a byte, so a byte budget alone let the index outgrow the host
// (1 GiB of budget: ~25M one-byte chunks, 4.7 GB of index, before the
// files' bound on records stops them). Past it the least
// recently used go, told as removed, as past Bytes; a rebuild keeps the
// newest MaxChunks.
func TestTheTierHoldsAtMostMaxChunks(t *testing.T) {
	const max, n = 8, 50
	ev := &events{}
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, MaxChunks: max}, ev.notify)
	require.NoError(t, err)
	data := func(i int) []byte { return []byte{byte(i)} }
	var all []messages.Key
	for i := range n {
		require.True(t, d.Spill("e", key(i), sum(data(i)), data(i)))
		all = append(all, key(i))
		waitOnDisk(t, d, key(i))
		require.LessOrEqual(t, d.Stats().Chunks, max, "after chunk %d", i)
	}
	require.Equal(t, all[n-max:], d.Keys(), "the newest, least recently used gone")
	stored, removed := ev.get()
	require.Equal(t, all, stored)
	require.Equal(t, all[:n-max], removed, "each one gone told as removed")
	for i := n - max; i < n; i++ {
		got, err := readBack(t, d, key(i), 1)
		require.NoError(t, err)
		require.Equal(t, data(i), got)
	}
	d.Close()

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20, MaxChunks: max / 2}, nil)
	require.NoError(t, err)
	t.Cleanup(d2.Close)
	require.Equal(t, all[n-max/2:], d2.Keys(), "a rebuild keeps the newest MaxChunks")
}

// The default bounds the index to a chunk per 4 KiB of budget, and never
// below 65,536 chunks (small budgets of small chunks, tests and benches,
// are not cut).
func TestMaxChunksDefault(t *testing.T) {
	for _, c := range []struct{ bytes, want int64 }{
		{1 << 20, 65536}, {256 << 20, 65536}, {1 << 30, 262144}, {100 << 30, 26214400},
	} {
		require.Equal(t, c.want, defaultMaxChunks(c.bytes), "budget %d", c.bytes)
	}
}
