package node

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A disk record under an engine's key whose size is not the chunk size of
// the key's group in the engine's layout (a geometry the disk key's 64-bit
// fingerprint failed to tell apart, a record left by another build) is no
// lookup hit: the load would refuse it (store.ErrCorrupt) and drop it, so
// counting it answered a hit the load then failed. A record of the right
// size under the same kind of key counts. The records are written straight
// into the node's disk tier, as a spill would write them.
func TestLookupDoesNotCountADiskRecordOfAnotherSize(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, func(c *Config) { c.DiskDir, c.DiskBytes = t.TempDir(), 1<<20 })
	registerOneEngine(t, nc, dir, "e1") // chunks of one 1 KiB block
	const fits, misfit = "6161616130303030", "6262626230303030"
	spillSized(t, n, fits, 1024)
	spillSized(t, n, misfit, 2048)
	lookup := func(h string) int { return lookupHits(t, nc, h) }
	require.Equal(t, 4, lookup(fits), "a record of the chunk's size")
	require.Zero(t, lookup(misfit), "a record the load refuses is counted")

	load := func(h string) messages.LoadReply {
		t.Helper()
		m, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.load",
			[]byte(`{"request":"l","hashes":["`+h+`"],"num_tokens":4,"blocks":[[2]]}`), 5*time.Second)
		require.NoError(t, err)
		var r messages.LoadReply
		require.NoError(t, json.Unmarshal(m.Data, &r))
		return r
	}
	require.True(t, load(fits).OK, "the counted record loads")
	require.False(t, load(misfit).OK, "the load refuses the record the lookup did not count")
}

// spillSized writes a size-byte record under engine e1's group-0 key for
// hash h straight into n's disk tier, as a spill would write it, and waits
// until the tier has indexed it.
func spillSized(t *testing.T, n *Node, h string, size int) {
	t.Helper()
	rec := n.engine("e1")
	require.NotNil(t, rec)
	hs, err := ingest.DecodeLookup([]byte(`{"hashes":["`+h+`"]}`), n.cfg.Limits)
	require.NoError(t, err)
	dk, ok := n.diskKeys.ToDisk(rec.layout.Key(hs[0], 0))
	require.True(t, ok)
	data := bytes.Repeat([]byte{0x5A}, size)
	require.True(t, n.disk.Spill("e1", dk, crc32.Checksum(data, crc32.MakeTable(crc32.Castagnoli)), data))
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if _, _, ok := n.disk.Has(dk); !ok {
			return fmt.Errorf("record %s not on disk yet", h)
		}
		return nil
	})
}

// spilled is a record spillSized writes: engine e1's chunk for hash h, of
// size bytes.
type spilled struct {
	h    string
	size int
}

// diskOfAnEarlierBoot is a Config option for a disk tier in a fresh
// directory that an earlier boot left holding records (e1 registered,
// each record spilled, the node closed): the next boot with it finds them
// on disk at e1's namespace's first register.
func diskOfAnEarlierBoot(t *testing.T, records ...spilled) func(*Config) {
	t.Helper()
	diskDir := t.TempDir()
	withDisk := func(c *Config) { c.DiskDir, c.DiskBytes = diskDir, 1<<20 }
	n, nc, dir := startInternal(t, withDisk)
	registerOneEngine(t, nc, dir, "e1")
	for _, r := range records {
		spillSized(t, n, r.h, r.size)
	}
	require.NoError(t, n.Close(context.Background()))
	return withDisk
}

// lookupHits is engine e1's lookup of hash h: the tokens it hits.
func lookupHits(t *testing.T, nc *nats.Conn, h string) int {
	t.Helper()
	m, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.lookup", []byte(`{"hashes":["`+h+`"]}`), 5*time.Second)
	require.NoError(t, err)
	var r messages.LookupReply
	require.NoError(t, json.Unmarshal(m.Data, &r))
	require.Empty(t, r.Error)
	return r.HitTokens
}
