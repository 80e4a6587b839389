package node

import (
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// gatedDevice holds every copy until gate gives it a turn.
type gatedDevice struct {
	backend.Attachment
	started chan struct{}
	gate    chan struct{}
}

func (d *gatedDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.started <- struct{}{}
	<-d.gate
	return d.Attachment.Copy(dir, a, r)
}

// After an engine actor fails, the node forgets the engine, which is told
// it is unknown, registers again and resyncs (engine.Deps.Failed); the
// failed actor's request r still copies block 1 (its engine_gone release
// waits for that copy). The new epoch re-announces r with block 1,
// preempted: its release waits until the failed actor has ended, so the
// engine never reuses block 1 under the old copy.
func TestAnEngineRegisteredAgainAfterItsActorFailedReleasesNothingUnderTheOldCopy(t *testing.T) {
	t.Parallel()
	started, gate := make(chan struct{}, 8), make(chan struct{}, 8)
	n, nc, dir := startInternal(t, func(c *Config) {
		c.WrapDevice = func(a backend.Attachment) backend.Attachment {
			return &gatedDevice{Attachment: a, started: started, gate: gate}
		}
	})
	t.Cleanup(func() { close(gate) })
	released := testkit.Subscribe(t, nc, "kvactors.e1.released")
	var arm atomic.Bool
	failWhenArmed(n, &arm, nil)
	seg, err := shm.Create(dir, "e1-failed", 4096)
	require.NoError(t, err)
	t.Cleanup(func() { _ = seg.Remove() })
	spec, _ := json.Marshal(messages.EngineSpec{TokensPerHash: 4, BlocksPerChunk: 1, NumGPUBlocks: 4,
		Segments: []messages.Segment{seg.Spec()}, Groups: []messages.GroupSpec{{Kind: "full", TokensPerBlock: 4,
			Regions: []messages.Region{{BlockStride: 1024, BlockBytes: 1024}}}}})
	register := func() {
		t.Helper()
		reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.register", spec, 5*time.Second)
		require.NoError(t, err)
		require.Contains(t, string(reply.Data), `"ok":true`)
	}
	register()
	readyR := `{"type":"added","request":"r","prompt_tokens":4},{"type":"hashes","request":"r","start":0,"hashes":["aa01"]},` +
		`{"type":"blocks","request":"r","group":0,"start":0,"ids":[1]},{"type":"tokens","request":"r","computed":4,"total":4}`
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[`+readyR+`]}`)))
	testkit.Recv(t, started, 5*time.Second, "r's copy of block 1 (epoch a)")

	arm.Store(true) // the engine actor fails on its next batch
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":2,"events":[]}`)))
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.heartbeat", []byte(`{"epoch":"a","seq":2}`), 5*time.Second)
		if err != nil {
			return err
		}
		if !strings.Contains(string(reply.Data), "unknown engine") {
			return fmt.Errorf("still known: %s", reply.Data)
		}
		return nil
	})
	n.mu.Lock()
	n.editEngine = nil
	n.mu.Unlock()

	register()
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"b","seq":1,"events":[`+readyR+
		`,{"type":"preempted","request":"r"}]}`)))
	require.NoError(t, nc.Flush())
	testkit.NoRecv(t, released, 300*time.Millisecond, "a release while epoch a's copy of block 1 still runs")

	gate <- struct{}{}
	var first, second messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "epoch a's release of r").Data, &first))
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "epoch b's release of r").Data, &second))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonEngineGone}, first)
	require.Equal(t, messages.Released{Request: "r", Epoch: "b", RSeq: 1, Reason: messages.ReasonPreempted}, second)

	// The failed actor has ended: the node keeps nothing of it (an engine
	// that never registered again would leave no entry either).
	testkit.Eventually(t, 5*time.Second, 5*time.Millisecond, func() error {
		n.mu.Lock()
		defer n.mu.Unlock()
		if left := len(n.ending["e1"]); left > 0 {
			return fmt.Errorf("%d ended actors of e1 still kept", left)
		}
		return nil
	})
}
