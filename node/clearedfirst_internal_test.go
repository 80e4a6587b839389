package node

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// An engine's first register in a boot publishes AllBlocksCleared on its
// kv_events before anything else (PROTOCOL.md v2 "Register reply"), even
// when the kv_events journal drains a change for it the moment the register
// makes it a member of its namespace: here a change to the namespace's keys
// by an engine outside it, which is announced on the namespace's member.
// The hook holds the register there until that change has been published.
func TestAllBlocksClearedComesBeforeAChangeDrainedAsTheEngineJoins(t *testing.T) {
	t.Parallel()
	n, nc, dir := startInternal(t, nil)
	kv := make(chan messages.KVEventBatch, 16)
	sub, err := nc.Subscribe("kvactors.e1.kv_events", func(m *nats.Msg) {
		var b messages.KVEventBatch
		if err := json.Unmarshal(m.Data, &b); err != nil {
			t.Errorf("kv_events %q: %v", m.Data, err)
			return
		}
		kv <- b
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	require.NoError(t, nc.Flush())

	var seen []string // event types on e1's kv_events, in order
	n.mu.Lock()
	n.committed = func(engine string, ns sched.NamespaceID) {
		n.kv.pool(false, []messages.Key{sched.Key(ns, "gone", 0)}, "other")
		deadline := time.After(5 * time.Second)
		for {
			select {
			case b := <-kv:
				for _, ev := range b.Events {
					seen = append(seen, ev.Type)
					if ev.Type == messages.KVBlockRemoved {
						return
					}
				}
			case <-deadline:
				t.Errorf("the change was not published on %s: saw %v", engine, seen)
				return
			}
		}
	}
	n.mu.Unlock()

	seg, err := shm.Create(dir, "e1-kv", 4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	spec, err := json.Marshal(messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 4,
		Namespace: "shared", Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full",
			TokensPerBlock: 4, Regions: []messages.Region{{BlockStride: 1024, BlockBytes: 1024}}}}})
	require.NoError(t, err)
	reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.register", spec, 10*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)
	n.mu.Lock() // seen was written under it
	defer n.mu.Unlock()
	require.Equal(t, []string{messages.KVAllBlocksCleared, messages.KVBlockRemoved}, seen)
}
