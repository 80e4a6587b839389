package actors

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// Subject builds P.E.verb once per engine for the verbs published per
// request or job, and stays right past its bound (it clears and rebuilds).
func TestOutboxSubjectsAreCachedPerEngine(t *testing.T) {
	o := NewOutbox(nil, "kv", nil)
	for _, verb := range []string{messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents,
		messages.VerbResync, "other"} {
		require.Equal(t, "kv.e1."+verb, o.Subject("e1", verb))
	}
	require.Zero(t, testing.AllocsPerRun(100, func() { _ = o.Subject("e1", messages.VerbStored) }),
		"a cached engine's subject is not built again")
	for i := range maxCachedEngines + 10 {
		e := fmt.Sprintf("e%d", i)
		require.Equal(t, "kv."+e+".stored", o.Subject(e, messages.VerbStored))
	}
	require.LessOrEqual(t, o.nsubjects.Load(), int64(maxCachedEngines))
	require.Equal(t, "kv.e1.released", o.Subject("e1", messages.VerbReleased))
}

// The reply rule's chokepoint (PROTOCOL.md "kvactors' choice, replies"):
// Outbox.Reply and Releases.Reply, the only ways the node publishes on a
// subject a message named, publish only on reply inboxes. Any other reply
// subject (an engine's verbs, JetStream's API and KV, kvactors' own
// inboxes, near misses of _INBOX.) is refused, counted and reported, and
// nothing goes out on it; no reply subject is no reply, not a refusal.
func TestOutboxRepliesOnlyOnReplyInboxes(t *testing.T) {
	_, nc := testkit.NATS(t)
	all := testkit.Subscribe(t, nc, ">")
	o := NewOutbox(nc, "kvactors", slog.New(slog.NewTextHandler(io.Discard, nil)))
	var refused []string
	o.OnRefusedReply(func(reply string) { refused = append(refused, reply) })
	rel := NewReleases(o, "vic")
	ctx := context.Background()
	heartbeat := func(uint64) any { return messages.HeartbeatReply{} }

	bad := []string{"kvactors.vic.unregister", "kvactors.vic.released", "$KV.kvactors_owners.vic",
		"$JS.API.STREAM.DELETE.KV_kvactors_owners", "_INBOX._kvactors.x", "_INBOX", "_INBOXx.y", "_inbox.e1.x"}
	var want []string
	for _, reply := range bad {
		o.Reply(ctx, reply, messages.RegisterReply{Error: "refused"})
		rel.Reply(ctx, reply, "a", heartbeat)
		want = append(want, reply, reply)
	}
	o.Reply(ctx, "", messages.RegisterReply{Error: "no reply"})
	rel.Reply(ctx, "", "a", heartbeat)
	o.Reply(ctx, "_INBOX.e1.x", messages.RegisterReply{OK: true})
	rel.Reply(ctx, "_INBOX.x", "a", heartbeat)
	// One connection: had anything gone out before these, it would come first.
	require.Equal(t, "_INBOX.e1.x", testkit.Recv(t, all, 5*time.Second, "the first reply").Subject)
	require.Equal(t, "_INBOX.x", testkit.Recv(t, all, 5*time.Second, "the second reply").Subject)
	require.Equal(t, int64(len(want)), o.RefusedReplies())
	require.Equal(t, want, refused)
}
