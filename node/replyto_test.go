package node_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
)

// An engine cannot borrow the node's permissions through a reply subject.
// Engine mal, whose credentials may publish only on kvactors.mal.> (and
// not on its own node-only verbs), sends its own heartbeat, lookup and
// register with reply subjects of the victim's (its resync, its
// unregister, which on a cluster would end vic at its owner) and of
// kvactors' own inboxes. The node answers none of them and handles none
// (the register with a bad reply registers nothing), counting each as
// bad_reply; mal's own requests with its own inbox are still served.
func TestTheNodeAnswersOnlyOnReplyInboxes(t *testing.T) {
	base, connect := securedNode(t, natsauth.Options{Engines: []string{"vic", "mal"}, Auth: natsauth.AuthPassword,
		BcryptCost: bcrypt.MinCost})
	vicEnv, malEnv := *base, *base
	vicEnv.nc = connect("vic", make(chan error, 64))
	malEnv.nc = connect("mal", make(chan error, 64))
	vic := vicEnv.newEngine("vic", defaultOpts())
	vic.register()
	mal := malEnv.newEngine("mal", defaultOpts())

	got := make(chan *nats.Msg, 8)
	for _, subj := range []string{"kvactors.vic.resync", "kvactors.vic.unregister", "kvactors.vic.released"} {
		_, err := vicEnv.nc.ChanSubscribe(subj, got)
		require.NoError(t, err)
	}
	require.NoError(t, vicEnv.nc.Flush())
	// Only kvactors' user may read kvactors' inboxes.
	service := connect(natsauth.ServiceUser, make(chan error, 64))
	own := testkit.Subscribe(t, service, natsauth.InboxPrefix(natsauth.ServiceUser)+".x")

	spec, err := json.Marshal(mal.spec)
	require.NoError(t, err)
	forged := []struct{ verb, reply, body string }{
		{"heartbeat", "kvactors.vic.resync", `{"epoch":"victims-epoch","seq":0}`},
		{"lookup", "kvactors.vic.unregister", `{"hashes":[]}`},
		{"status", "kvactors.vic.released", `{}`},
		{"lookup", natsauth.InboxPrefix(natsauth.ServiceUser) + ".x", `{"hashes":[]}`},
		{"register", "kvactors.vic.unregister", string(spec)},
	}
	for _, f := range forged {
		require.NoError(t, malEnv.nc.PublishRequest("kvactors.mal."+f.verb, f.reply, []byte(f.body)))
	}
	require.NoError(t, malEnv.nc.Flush())
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if n := base.counter("kvactors_events_rejected_total", messages.RejectBadReply); n != float64(len(forged)) {
			return fmt.Errorf("%v refused as bad_reply, want %d", n, len(forged))
		}
		return nil
	})
	// Each forged message was refused before it was queued, so the node has
	// nothing of them left to publish once mal's next request is answered;
	// a round trip on each watching connection delivers what the server
	// had routed to it before.
	reply := mal.request("lookup", map[string]any{"hashes": []string{}})
	require.Contains(t, string(reply), "unknown engine", "the register with a bad reply registered nothing")
	require.NoError(t, vicEnv.nc.Flush())
	require.NoError(t, service.Flush())
	testkit.NoRecv(t, got, 0, "a node publish on a subject mal named")
	testkit.NoRecv(t, own, 0, "a node publish on kvactors' own inbox")

	mal.register()
	reply = mal.request("lookup", map[string]any{"hashes": []string{}})
	require.Contains(t, string(reply), `"hit_tokens":0`, "mal's own requests are served")
}
