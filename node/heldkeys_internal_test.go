package node

import (
	"testing"

	"github.com/stretchr/testify/require"

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
	h := &heldKeys{m: map[holders.NSKey]bool{}}
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
