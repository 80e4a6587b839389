package testkit

import (
	"os"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

// readyTimeout bounds the wait for the embedded server to accept clients.
const readyTimeout = 10 * time.Second

// subscribeBuffer is the channel capacity of Subscribe: generous, so that a
// test that reads slowly sees every message instead of a slow-consumer drop.
const subscribeBuffer = 1 << 14

// NATS starts an embedded NATS server (see NATSServer) and connects a client
// to it. Both are closed when the test ends: the client first.
func NATS(t testing.TB) (*server.Server, *nats.Conn) {
	t.Helper()
	s := NATSServer(t)
	return s, Connect(t, s)
}

// NATSServer starts an embedded nats-server on 127.0.0.1 and a random port,
// with JetStream on and its store in t.TempDir(), and waits until it accepts
// connections. It is silent unless NATS_LOGGING is "debug" or "trace". The
// server is shut down, and waited for, when the test ends.
func NATSServer(t testing.TB) *server.Server {
	t.Helper()
	return NATSServerWith(t, nil)
}

// NATSServerWith is NATSServer with its options changed by edit first (a
// smaller max_payload, say).
func NATSServerWith(t testing.TB, edit func(*server.Options)) *server.Server {
	t.Helper()
	opts := &server.Options{
		Host:      "127.0.0.1", // never listen beyond loopback in a test
		Port:      server.RANDOM_PORT,
		JetStream: true,
		StoreDir:  t.TempDir(),
		NoLog:     true,
		NoSigs:    true, // the test process owns its signals
	}
	switch os.Getenv("NATS_LOGGING") {
	case "debug":
		opts.NoLog, opts.Debug = false, true
	case "trace":
		opts.NoLog, opts.Debug, opts.Trace = false, true, true
	}
	if edit != nil {
		edit(opts)
	}
	s, err := server.NewServer(opts)
	require.NoError(t, err, "create the NATS server")
	s.ConfigureLogger() // a no-op under NoLog
	// Registered before Start, so a failed start is cleaned up too. It runs
	// after Connect's clean-up (t.Cleanup is LIFO) and before t.TempDir's.
	t.Cleanup(func() {
		s.Shutdown()
		s.WaitForShutdown()
	})
	s.Start() // does not block
	if !s.ReadyForConnections(readyTimeout) {
		t.Fatalf("NATS server not ready for connections after %v", readyTimeout)
	}
	return s
}

// Connect connects a client to s, named after the test, and closes it when
// the test ends.
func Connect(t testing.TB, s *server.Server) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(s.ClientURL(), nats.Name(t.Name()))
	require.NoError(t, err, "connect to the NATS server at %s", s.ClientURL())
	t.Cleanup(nc.Close)
	return nc
}

// Subscribe subscribes nc to subject and returns the channel the messages
// arrive on. It flushes, so the server knows the subscription before
// Subscribe returns: a message published afterwards is never missed. The
// subscription ends when the test does.
func Subscribe(t testing.TB, nc *nats.Conn, subject string) <-chan *nats.Msg {
	t.Helper()
	ch := make(chan *nats.Msg, subscribeBuffer)
	sub, err := nc.ChanSubscribe(subject, ch)
	require.NoError(t, err, "subscribe to %q", subject)
	t.Cleanup(func() {
		// The connection may already be closed by the test; nothing to undo then.
		_ = sub.Unsubscribe()
	})
	require.NoError(t, nc.Flush(), "flush the subscription to %q", subject)
	return ch
}
