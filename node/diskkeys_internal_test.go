package node

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// Disk keys round-trip within a boot, map to the namespace's id of the new
// boot after a restart, refuse an unknown namespace or another geometry, and
// refuse malformed input without panicking.
func TestDiskKeys(t *testing.T) {
	spec := func(bpc int) *sched.Layout { return oneGroupLayout(t, bpc, 8) }
	boot1 := newDiskKeys()
	boot1.learn(1, "alpha", spec(1))
	boot1.learn(2, "beta", spec(1))
	k := sched.Key(1, "hash", 3)
	dk, ok := boot1.ToDisk(k)
	require.True(t, ok)
	back, ok := boot1.FromDisk(dk)
	require.True(t, ok)
	require.Equal(t, k, back)
	_, ok = boot1.ToDisk(sched.Key(9, "hash", 3))
	require.False(t, ok, "a namespace never learnt is not written")

	boot2 := newDiskKeys() // beta registered first this time
	boot2.learn(1, "beta", spec(1))
	boot2.learn(2, "alpha", spec(1))
	back, ok = boot2.FromDisk(dk)
	require.True(t, ok)
	require.Equal(t, sched.Key(2, "hash", 3), back, "alpha's chunk comes back under alpha's new id")

	boot3 := newDiskKeys()
	boot3.learn(1, "alpha", spec(2)) // same name, other geometry
	_, ok = boot3.FromDisk(dk)
	require.False(t, ok, "another geometry: a miss")

	for _, bad := range []messages.Key{"", "\xff", "\x05ab", messages.Key(string(dk[:len(dk)-9]))} {
		_, ok := boot1.FromDisk(bad)
		require.False(t, ok, "%q", bad)
	}
	_, ok = boot1.ToDisk("ab")
	require.False(t, ok)
}

// oneGroupLayout is the layout of a spec of one full-attention group of 4
// tokens per block, bpc blocks per chunk and one region of blockBytes.
func oneGroupLayout(t *testing.T, bpc int, blockBytes int64) *sched.Layout {
	t.Helper()
	l, err := sched.NewLayout(&messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: bpc, NumGPUBlocks: 8,
		Segments: []messages.Segment{{Shm: "s"}}, Groups: []messages.GroupSpec{{Kind: messages.KindFull,
			TokensPerBlock: 4, Regions: []messages.Region{{BlockStride: blockBytes, BlockBytes: blockBytes}}}}})
	require.NoError(t, err)
	return l
}
