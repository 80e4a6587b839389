package sim_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/node"
	"github.com/kvactors/kvactors/sim"
)

// TestLookupThatHitsNothingFailsTheCheck puts a proxy between the engine
// (prefix kvactors) and a real node (prefix kvnode) that passes everything
// on but answers every lookup with 0 hit tokens, as a node whose lookup is
// broken would. Nothing is evicted, so the stored chunks the check then
// loads back were there when it looked them up: the check must fail.
func TestLookupThatHitsNothingFailsTheCheck(t *testing.T) {
	dir := t.TempDir()
	n, err := node.Start(context.Background(), node.Config{NATSPort: -1, Prefix: "kvnode", ShmDir: dir,
		PoolBytes: 64 << 20, HTTPAddr: node.HTTPOff, Log: quietLog()})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })
	nc, err := nats.Connect(n.NATSURL())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	cfg := smallConfig("e1", dir)
	cfg.Requests = 10
	proxy := engineConn(t, nc, cfg.Engine) // the engine's inbox: the node answers the proxy's lookups there

	// One subscription per direction keeps each direction's order.
	forward := func(from, to string, verbs ...string) {
		_, err := proxy.Subscribe(from+".>", func(m *nats.Msg) {
			rest := strings.TrimPrefix(m.Subject, from)
			verb := rest[strings.LastIndexByte(rest, '.')+1:]
			switch {
			case strings.HasPrefix(rest, "."+messages.NodeToken+"."), !contains(verbs, verb):
				return
			case verb == messages.VerbLookup:
				r, err := proxy.RequestMsg(&nats.Msg{Subject: to + rest, Header: m.Header, Data: m.Data},
					cfg.RequestTimeout)
				if err != nil {
					return // the engine's request times out and the run fails
				}
				var reply messages.LookupReply
				require.NoError(t, json.Unmarshal(r.Data, &reply))
				reply.HitTokens = 0
				data, err := json.Marshal(reply)
				require.NoError(t, err)
				_ = m.Respond(data)
			default:
				_ = proxy.PublishMsg(&nats.Msg{Subject: to + rest, Reply: m.Reply, Header: m.Header, Data: m.Data})
			}
		})
		require.NoError(t, err)
	}
	forward("kvactors", "kvnode", messages.VerbRegister, messages.VerbEvents, messages.VerbHeartbeat,
		messages.VerbUnregister, messages.VerbLookup, messages.VerbLoad, messages.VerbStatus)
	forward("kvnode", "kvactors", messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents,
		messages.VerbResync)
	require.NoError(t, proxy.Flush())

	rep, err := sim.Run(runCtx(t), engineConn(t, nc, cfg.Engine), cfg)
	require.NoError(t, err)
	t.Logf("report: %+v", rep)
	require.Positive(t, rep.Lookups)
	require.Positive(t, rep.VerifyOK, "the stored chunks load back")
	require.Zero(t, rep.Evictions)
	require.ErrorIs(t, rep.Err(), sim.ErrCheck)
	require.Contains(t, strings.Join(rep.Failures, "\n"), "lookup of")
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}
