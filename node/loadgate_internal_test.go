package node

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// An engine's load gate waits for the loads in flight and lets none in once
// the engine is ending: a load taken just before an expiry detaches the
// engine must either be waited for or refused, never copy into segments
// being unmapped.
func TestLoadGateRefusesLoadsOnceEnding(t *testing.T) {
	var g loadGate
	require.True(t, g.enter(), "a live engine takes loads")
	waited := make(chan struct{})
	go func() {
		g.closeAndWait()
		close(waited)
	}()
	// The closer marks the gate before it waits: once it has, enter fails.
	deadline := time.After(5 * time.Second)
	for g.enter() {
		g.leave() // let in before the close: in flight, so leave it again
		select {
		case <-deadline:
			t.Fatal("enter still succeeds after closeAndWait began")
		case <-waited:
			t.Fatal("closeAndWait returned with a load in flight")
		default:
		}
	}
	select {
	case <-waited:
		t.Fatal("closeAndWait returned with a load in flight")
	case <-time.After(20 * time.Millisecond): // no event to wait on: the wait must not end by itself
	}
	g.leave()
	select {
	case <-waited:
	case <-time.After(5 * time.Second):
		t.Fatal("closeAndWait did not return once the last load left")
	}
	require.False(t, g.enter(), "an ended engine takes no load")
}

// toldDevice passes copies through, telling each one's direction.
type toldDevice struct {
	backend.Attachment
	copies chan backend.Direction
	hold   chan struct{} // when set, each copy waits for it to close
}

func (d *toldDevice) Copy(dir backend.Direction, a backend.Arena, r []backend.Range) error {
	d.copies <- dir
	if d.hold != nil {
		<-d.hold
	}
	return d.Attachment.Copy(dir, a, r)
}

// A load whose ingest worker took its engine's record before the engine
// ended (an expiry decided on the engine actor's goroutine, an unregister)
// reaches startLoad after the engine's end closed its load gate and
// unmapped its segments: startLoad refuses it as a load of an unknown
// engine, pins nothing (and lets go of the pin a fetch handed it) and never
// copies into the unmapped blocks. The race
// is played in order: the record is taken, the engine unregistered (its
// reply comes once the gate is closed and the device unmapped), then the
// rest of the worker's path runs with the old record.
func TestALoadThatRacedItsEnginesEndIsRefused(t *testing.T) {
	t.Parallel()
	dev := &toldDevice{copies: make(chan backend.Direction, 16)}
	n, nc, dir := startInternal(t, func(c *Config) {
		c.WrapDevice = func(d backend.Attachment) backend.Attachment { dev.Attachment = d; return dev }
	})
	registerOneEngine(t, nc, dir, "e1")

	// One chunk stored, so the load would find its key ready and copy.
	const h = "6161616130303030"
	stored := testkit.Subscribe(t, nc, "kvactors.e1.stored")
	require.NoError(t, nc.Publish("kvactors.e1.events", []byte(`{"epoch":"a","seq":1,"events":[`+
		`{"type":"added","request":"a","prompt_tokens":4},{"type":"hashes","request":"a","start":0,"hashes":["`+h+`"]},`+
		`{"type":"blocks","request":"a","group":0,"start":0,"ids":[1]},{"type":"tokens","request":"a","computed":4,"total":4}]}`)))
	testkit.Recv(t, stored, 5*time.Second, "a's chunk stored")
	require.Equal(t, backend.DeviceToHost, testkit.Recv(t, dev.copies, 5*time.Second, "the store's copy"))

	rec := n.engine("e1") // the worker's look-up, before the end
	require.NotNil(t, rec)
	req, err := ingest.DecodeLoad([]byte(`{"request":"l","hashes":["`+h+`"],"num_tokens":4,"blocks":[[2]]}`), n.cfg.Limits)
	require.NoError(t, err)
	chunks, err := rec.layout.LoadChunks(req.Hashes, req.NumTokens, req.Blocks)
	require.NoError(t, err)
	keys := []messages.Key{chunks[0].Key}
	require.True(t, n.store.Ready(keys[0]), "the load's key is loadable")

	reply, err := testkit.EngineRequest(nc, "e1", "kvactors.e1.unregister", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(reply.Data), `"ok":true`)

	// As if a remote fetch had made the key ready: pinned, handed to the
	// load, which must let go of that pin too when refused.
	_, err = rec.store.PrepareLoad(keys)
	require.NoError(t, err)
	failed := make(chan error, 1)
	n.startLoad(context.Background(), trace.SpanFromContext(context.Background()), rec, req, chunks, keys, "", len(keys), nil, keys, n.fence.Gen(), rec.hearing.Gen(), func(err error) { failed <- err })
	select {
	case err := <-failed:
		require.ErrorIs(t, err, errUnknownEngine)
	case dir := <-dev.copies:
		t.Fatalf("the load copied (%v) after its engine ended", dir)
	case <-time.After(5 * time.Second):
		t.Fatal("the load neither refused nor copied")
	}
	require.Zero(t, n.store.Stats().Pinned, "the refused load pinned its key, or kept its fetch's pin")
	// A copy would have been handed to a load actor and a copy worker; the
	// transfer actor stops only once its workers are idle, so after Close
	// none is still to come.
	require.NoError(t, n.Close(context.Background()))
	testkit.NoRecv(t, dev.copies, 0, "a copy into the ended engine's blocks")
}
