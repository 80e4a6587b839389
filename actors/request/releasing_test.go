package request_test

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/actors/request"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// The releasing flag is up before the final release can go out, not just by
// the time an engine reads it: the engine's released reply may be read, and
// the id reused, the instant the release is written. Here the release cannot
// be written: a heartbeat reply being built holds the engine's Releases lock,
// which every release is numbered and published under. The request applies
// its finish on another goroutine and stops in Publish; the flag must already
// be up (raised after the publish, it stays down until the lock is let go).
func TestTheReleasingFlagIsUpWhileTheFinalReleaseWaitsToGoOut(t *testing.T) {
	_, nc := testkit.NATS(t)
	released := testkit.Subscribe(t, nc, "kvactors.e.released")
	rig := newHeldRig(t, nc, 16)
	var releasing request.Releasing
	pid := request.NewSpawner().SpawnWatched(rig.system.Root, &rig.deps, &messages.Event{Type: messages.EvAdded,
		Request: "r", PromptTokens: 8, MaxOffloadTokens: -1}, context.Background(), &releasing)

	holding, gate := make(chan struct{}, 1), make(chan struct{})
	var open sync.Once
	letGo := func() { open.Do(func() { close(gate) }) }
	t.Cleanup(letGo) // a failed test leaves no goroutine blocked on the lock
	go rig.deps.Releases.Reply(context.Background(), "_INBOX.test.reply", "a", func(uint64) any {
		holding <- struct{}{}
		<-gate
		return messages.HeartbeatReply{}
	})
	testkit.Recv(t, holding, 5*time.Second, "the Releases lock held")

	// No blocks: the finish releases for good at once, in this message's
	// turn, which runs on the sending goroutine (the actor is idle) and
	// blocks there in Publish.
	sent := make(chan struct{}, 1)
	go func() {
		defer func() { sent <- struct{}{} }()
		rig.system.Root.Send(pid, &request.Events{Events: []messages.Event{
			{Type: messages.EvFinished, Request: "r", Computed: 0, Total: 8}}})
	}()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if !releasing.Load() {
			return errors.New("the releasing flag is down while the final release waits to be published")
		}
		return nil
	})
	select {
	case m := <-released:
		t.Fatalf("a release went out while the Releases lock was held: %s", m.Data)
	default:
	}

	letGo()
	var rel messages.Released
	require.NoError(t, json.Unmarshal(testkit.Recv(t, released, 5*time.Second, "the final release").Data, &rel))
	require.Equal(t, messages.Released{Request: "r", Epoch: "a", RSeq: 1, Reason: messages.ReasonFinished}, rel)
	testkit.Recv(t, sent, 5*time.Second, "the finish's turn to end")
}
