package actors

import (
	"context"
	"encoding/json"
	"log/slog"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// A message the NATS client refuses is lost, not retried: the outbox counts
// it by kind, tells its hook, and logs it rate limited per kind (five lines
// a kind, as refused input: an outage of a busy node would otherwise log
// every message it could not send). Two real refusals: a kv_events body
// over the server's max_payload, and a release published while the link is
// cut (no reconnect buffer: it stands for a full one). The lost release is
// still counted in the heartbeat reply's released, which is how an engine
// finds it lost and resyncs (PROTOCOL.md, engine step 12).
func TestOutboxCountsAndRateLimitsTheMessagesItLoses(t *testing.T) {
	s := testkit.NATSServer(t)
	link := testkit.NewLink(t, s.Addr().String())
	down, up := make(chan struct{}, 1), make(chan struct{}, 1)
	nc, err := nats.Connect("nats://"+link.Addr, nats.ReconnectBufSize(-1), nats.MaxReconnects(-1),
		nats.ReconnectWait(20*time.Millisecond), nats.IgnoreDiscoveredServers(),
		nats.DisconnectErrHandler(func(*nats.Conn, error) { down <- struct{}{} }),
		nats.ReconnectHandler(func(*nats.Conn) { up <- struct{}{} }))
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	all := testkit.Subscribe(t, testkit.Connect(t, s), ">") // not through the link

	var logs testkit.SyncBuffer
	o := NewOutbox(nc, "kv", slog.New(slog.NewTextHandler(&logs, nil)))
	var kinds []string
	o.OnPublishFailed(func(kind string) { kinds = append(kinds, kind) })
	rel := NewReleases(o, "e1")
	ctx := context.Background()

	const over = 8
	big := make([]byte, nc.MaxPayload()+1)
	for range over {
		o.KVEventsBody(ctx, "e1", 0, big)
	}

	link.Cut()
	testkit.Recv(t, down, 5*time.Second, "the client to see its link cut")
	require.True(t, rel.Publish(ctx, "ep", "r1", messages.ReasonFinished, nil), "published, as far as the outbox knows")
	link.Restore()
	testkit.Recv(t, up, 5*time.Second, "the client to reconnect")

	rel.Reply(ctx, "_INBOX.hb", "ep", func(n uint64) any { return messages.HeartbeatReply{Released: n} })
	// One connection: had the release or a kv_events gone out, it would come first.
	m := testkit.Recv(t, all, 5*time.Second, "the heartbeat reply")
	require.Equal(t, "_INBOX.hb", m.Subject)
	var hb messages.HeartbeatReply
	require.NoError(t, json.Unmarshal(m.Data, &hb))
	require.Equal(t, uint64(1), hb.Released, "the lost release is counted: the engine, having received none, resyncs")

	require.Equal(t, int64(over+1), o.PublishFailures())
	require.Equal(t, append(slices.Repeat([]string{messages.VerbKVEvents}, over), messages.VerbReleased), kinds)
	lines := strings.Split(logs.String(), "\n")
	count := func(reason string) (n int) {
		for _, l := range lines {
			if strings.Contains(l, "publish failed: message lost") && strings.Contains(l, "reason="+reason) {
				n++
			}
		}
		return n
	}
	require.Equal(t, 5, count("publish_kv_events"), "past five a minute, a kind's failures are only counted")
	require.Equal(t, 1, count("publish_released"), "each kind has its own five")
	require.Contains(t, logs.String(), nats.ErrMaxPayload.Error())
	require.Contains(t, logs.String(), nats.ErrReconnectBufExceeded.Error())
}
