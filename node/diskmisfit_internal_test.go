package node

import (
	"encoding/json"
	"log/slog"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// A record on disk under an engine's key whose size is not the chunk size
// of the key's group (a geometry the disk key's fingerprint failed to tell
// apart, a record left by another build: injected here, written into the
// disk tier of the first boot as a spill would write it) was announced
// BlockStored DISK at the namespace's first register of the next boot,
// though no lookup counts it and every load refuses it. That register now
// drops it (counted in kvactors_pool_corrupt_chunks_total, logged) and
// announces only the record of the chunk's size; the router's beliefs,
// applied in order, are what the lookups find.
func TestARestartDropsADiskRecordOfAnotherSizeUnannounced(t *testing.T) {
	t.Parallel()
	const fits, misfit = "6161616130303030", "6262626230303030"
	// Chunks of one 1 KiB block; a record of each size.
	withDisk := diskOfAnEarlierBoot(t, spilled{fits, 1024}, spilled{misfit, 2048})

	// The next boot on that disk: a router follows e1's kv_events.
	watch := logWatch{msg: "disk: records of another size than their group's chunks dropped (a load would refuse them)",
		seen: make(chan string, 4)}
	n2, nc2, dir2 := startInternal(t, func(c *Config) { withDisk(c); c.Log = slog.New(watch) })
	events := make(chan messages.KVEvent, 64)
	sub, err := nc2.Subscribe("kvactors.e1.kv_events", func(m *nats.Msg) {
		var b messages.KVEventBatch
		if json.Unmarshal(m.Data, &b) == nil {
			for _, ev := range b.Events {
				events <- ev
			}
		}
	})
	require.NoError(t, err)
	defer func() { _ = sub.Unsubscribe() }()
	require.NoError(t, nc2.Flush())
	registerOneEngine(t, nc2, dir2, "e1")

	believed := map[string]bool{}
	var storedMisfit bool
	deadline := time.After(5 * time.Second)
	for !believed[fits] || n2.disk.Stats().Chunks != 1 {
		select {
		case ev := <-events:
			if ev.Medium != messages.MediumDisk {
				continue
			}
			switch ev.Type {
			case messages.KVAllBlocksCleared:
				clear(believed)
			case messages.KVBlockStored:
				for _, h := range ev.BlockHashes {
					believed[h] = true
					storedMisfit = storedMisfit || h == misfit
				}
			case messages.KVBlockRemoved:
				for _, h := range ev.BlockHashes {
					delete(believed, h)
				}
			}
		case <-deadline:
			t.Fatalf("the router believes %v; %d records on disk", believed, n2.disk.Stats().Chunks)
		}
	}
	require.False(t, storedMisfit, "the record of another size was announced stored")
	require.Equal(t, map[string]bool{fits: true}, believed)
	select {
	case <-watch.seen:
	case <-time.After(5 * time.Second):
		t.Fatal("the drop was not logged")
	}
	require.Equal(t, 1.0, testutil.ToFloat64(n2.metrics.Pool.Corrupt), "the dropped record is counted")

	require.Equal(t, 4, lookupHits(t, nc2, fits), "the record of the chunk's size is served")
	require.Zero(t, lookupHits(t, nc2, misfit))
}
