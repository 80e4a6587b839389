package node_test

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
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
	t.Parallel()
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

// A message whose subject fails to parse is answered with an error, but
// only on a reply inbox: the reply rule comes first, at the intake, and
// again at the outbox, the one place every reply goes out. Router rt may
// publish on P.*.status, so kvactors._x.status, a 65-byte engine id and
// kvactors.a$b.status all reach the node and fail ParseSubject; with
// reply subjects of vic's (its unregister, its released) and of the
// ownership bucket, an answer would publish there with the node's rights
// (JetStream is on, so those cover $KV.>). A watcher that may read every
// subject sees none of them; rt's status request for vic, taken after
// them, is answered (so they were all handled before), each is counted
// as bad_reply and none as bad_subject, and vic stays registered. The
// same bad subject with rt's own inbox is answered with the error.
func TestABadSubjectIsAnsweredOnlyOnAReplyInbox(t *testing.T) {
	t.Parallel()
	const watcher, watcherPassword = "watch", "watch-password"
	base, connect := securedNode(t, natsauth.Options{Engines: []string{"vic"}, Routers: []string{"rt"},
		JetStream: true, Auth: natsauth.AuthPassword, BcryptCost: bcrypt.MinCost}, func(cfg *node.Config) {
		// One more user, only for the test: it may read everything.
		conf, err := os.ReadFile(cfg.NATSConfig)
		require.NoError(t, err)
		user := fmt.Sprintf("users = [\n    { user: %q, password: %q, permissions: { publish: { allow: [%q] }, "+
			"subscribe: { allow: [\">\"] } } },\n", watcher, watcherPassword, natsauth.InboxPrefix(watcher)+".>")
		require.Contains(t, string(conf), "users = [\n")
		require.NoError(t, os.WriteFile(cfg.NATSConfig, []byte(strings.Replace(string(conf), "users = [\n", user, 1)),
			0o600))
	})
	vicEnv := *base
	vicEnv.nc = connect("vic", make(chan error, 64))
	vic := vicEnv.newEngine("vic", defaultOpts())
	vic.register()
	rt := connect("rt", make(chan error, 64))
	watch, err := nats.Connect(base.node.NATSURL(), nats.UserInfo(watcher, watcherPassword),
		nats.CustomInboxPrefix(natsauth.InboxPrefix(watcher)))
	require.NoError(t, err)
	t.Cleanup(watch.Close)

	victims := []string{"kvactors.vic.unregister", "kvactors.vic.released", "$KV.kvactors_owners.vic"}
	seen := make(chan *nats.Msg, 64)
	for _, subj := range []string{"kvactors.vic.unregister", "kvactors.vic.released", "$KV.>",
		natsauth.InboxPrefix("rt") + ".>"} {
		_, err := watch.ChanSubscribe(subj, seen)
		require.NoError(t, err)
	}
	require.NoError(t, watch.Flush())

	bad := []string{"kvactors._x.status", "kvactors." + strings.Repeat("a", 65) + ".status", "kvactors.a$b.status"}
	for _, subj := range bad {
		for _, reply := range victims {
			require.NoError(t, rt.PublishRequest(subj, reply, []byte(`{}`)))
		}
	}
	// A bad subject is still answered, on a reply inbox.
	msg, err := rt.Request("kvactors._x.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(msg.Data), "bad subject")
	// Taken after every forged message (one subscription, in order), and
	// answered on the node's connection after anything it published for
	// them: the watcher gets the answer after those, if any.
	msg, err = rt.Request("kvactors.vic.status", []byte(`{}`), 5*time.Second)
	require.NoError(t, err)
	require.Contains(t, string(msg.Data), `"engine":"vic"`, "vic's status")
	for {
		m := testkit.Recv(t, seen, 5*time.Second, "the status reply, at the watcher")
		require.True(t, strings.HasPrefix(m.Subject, natsauth.InboxPrefix("rt")+"."),
			"the node published on %s (%s), a reply subject the router named", m.Subject, m.Data)
		if m.Subject == msg.Subject {
			break
		}
	}
	require.Equal(t, float64(len(bad)*len(victims)), base.counter("kvactors_events_rejected_total",
		messages.RejectBadReply), "each refused as bad_reply")
	require.Equal(t, 1.0, base.counter("kvactors_events_rejected_total", messages.RejectBadSubject),
		"the reply rule comes before the subject's: only the one with rt's inbox is a bad subject")
	hb := vic.heartbeat("e1", 0)
	require.Empty(t, hb.Error, "vic still registered")
	require.Equal(t, base.node.Boot(), hb.Boot)
}

// PROTOCOL.md "kvactors' choice, replies": an engine's verbs (all but
// status) are answered only in its own inbox, _INBOX.<E>., the one its NATS
// permissions let it read. Engine mal names vic's inbox, another prefix
// that merely starts with its id, and a default nats.go inbox as the reply
// of its own requests: each is refused as bad_reply, handled not at all
// (the unregister leaves mal registered) and answered nowhere; a status
// request, which anyone may send, is answered wherever its inbox is.
func TestAnEnginesRequestsAreAnsweredOnlyInItsOwnInbox(t *testing.T) {
	t.Parallel()
	e := startNode(t)
	mal := e.newEngine("mal", defaultOpts())
	mal.register()
	elsewhere := make(chan *nats.Msg, 16)
	_, err := e.nc.ChanSubscribe("_INBOX.>", elsewhere)
	require.NoError(t, err)
	require.NoError(t, e.nc.Flush())

	spec, err := json.Marshal(mal.spec)
	require.NoError(t, err)
	forged := []struct{ verb, reply, body string }{
		{"lookup", "_INBOX.vic.pending", `{"hashes":[]}`},
		{"heartbeat", "_INBOX.vic.pending", `{"epoch":"ep1","seq":0}`},
		{"load", "_INBOX.vic.pending", `{"request":"l","hashes":[],"num_tokens":0,"blocks":[[]]}`},
		{"register", "_INBOX.vic.pending", string(spec)},
		{"unregister", "_INBOX.vic.pending", `{}`},
		{"lookup", "_INBOX.malx.pending", `{"hashes":[]}`},
		{"lookup", "_INBOX.mal", `{"hashes":[]}`},
		{"lookup", nats.NewInbox(), `{"hashes":[]}`},
	}
	for _, f := range forged {
		require.NoError(t, e.nc.PublishRequest("kvactors.mal."+f.verb, f.reply, []byte(f.body)))
	}
	// Taken after them on the one subscription: once it is answered, every
	// forged message was refused (before it was queued) and nothing of them
	// is left to publish; a flush delivers what the server routed before.
	reply := mal.request("lookup", map[string]any{"hashes": []string{}})
	require.Contains(t, string(reply), `"hit_tokens":0`, "mal's own inbox is answered, and mal is still registered")
	require.NoError(t, e.nc.Flush())
	require.Equal(t, float64(len(forged)), e.counter("kvactors_events_rejected_total", messages.RejectBadReply))
	for {
		select {
		case m := <-elsewhere:
			require.True(t, strings.HasPrefix(m.Subject, "_INBOX.mal."), "the node answered mal in %s: %s",
				m.Subject, m.Data)
			continue
		default:
		}
		break
	}

	// status: anyone may ask (routers, tools), in any reply inbox.
	require.NoError(t, e.nc.PublishRequest("kvactors.mal.status", "_INBOX.vic.status", []byte(`{}`)))
	m := testkit.Recv(t, elsewhere, 5*time.Second, "the status reply")
	for strings.HasPrefix(m.Subject, "_INBOX.mal.") { // mal's own lookup's, if still in flight
		m = testkit.Recv(t, elsewhere, 5*time.Second, "the status reply")
	}
	require.Equal(t, "_INBOX.vic.status", m.Subject)
	require.Contains(t, string(m.Data), `"engine":"mal"`)
}
