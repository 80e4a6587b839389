package testkit

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"
)

// A message published on one server reaches a subscriber on another, a
// replicated KV bucket is usable from every server, and stopping one server
// leaves the other two serving it, also after it comes back.
func TestNATSClusterRoutesAndReplicatesAcrossARestart(t *testing.T) {
	c := NATSCluster(t, 3)
	a, b := c.Connect(0), c.Connect(2)
	ch := Subscribe(t, b, "x.>")
	// Route interest propagates asynchronously: poll until a publish lands.
	Eventually(t, 5*time.Second, 20*time.Millisecond, func() error {
		require.NoError(t, a.Publish("x.y", []byte("hi")))
		select {
		case m := <-ch:
			require.Equal(t, "hi", string(m.Data))
			return nil
		case <-time.After(20 * time.Millisecond):
			return errNoRoute
		}
	})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	jsA, err := jetstream.New(a)
	require.NoError(t, err)
	kv, err := jsA.CreateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: "t", Replicas: 3})
	require.NoError(t, err)
	_, err = kv.Put(ctx, "k", []byte("v1"))
	require.NoError(t, err)

	c.Stop(0) // a fails over to s1 or s2
	jsB, err := jetstream.New(b)
	require.NoError(t, err)
	// Stopping a server may take the JetStream meta leader with it; the
	// survivors elect another within NATS' election timeout (seconds), and
	// until then stream lookups time out. Each try has its own deadline.
	var kvB jetstream.KeyValue
	Eventually(t, 30*time.Second, 100*time.Millisecond, func() error {
		try, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer cancel()
		if kvB == nil {
			kv, err := jsB.KeyValue(try, "t")
			if err != nil {
				return err
			}
			kvB = kv
		}
		_, err := kvB.Put(try, "k", []byte("v2"))
		return err
	})
	c.Restart(0)
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	e, err := kvB.Get(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, "v2", string(e.Value()))
	require.NotNil(t, c.Server(0))
}

var errNoRoute = errorString("no message across the route yet")

type errorString string

func (e errorString) Error() string { return string(e) }

// WaitRoutedTo returns once a subscriber on one server is reachable from
// every other: one publish each, no retry, reaches it. A stopped server is
// not waited for; a subject nobody subscribes to is waited for until the
// deadline, and the failure names the server that does not route it.
func TestWaitRoutedToReturnsOnceEveryServerRoutesToANewSubscriber(t *testing.T) {
	t.Parallel()
	c := NATSCluster(t, 3)
	const subject = "kvactors.e1.register"
	ch := Subscribe(t, c.Connect(1), "kvactors.*.*")
	c.WaitRoutedTo(c.Server(1).ID(), subject)
	for _, s := range []int{0, 2} {
		nc := c.Connect(s)
		require.NoError(t, nc.Publish(subject, []byte{byte(s)}))
		require.NoError(t, nc.Flush())
		require.Equal(t, []byte{byte(s)}, Recv(t, ch, 5*time.Second, "the register published once on another server").Data)
	}

	c.Stop(2)
	Subscribe(t, c.Connect(0), "kvactors.e2.register")
	c.WaitRoutedTo(c.Server(0).ID(), "kvactors.e2.register")

	msg := failure(t, func(tb testing.TB) {
		(&Cluster{Cluster: c.Cluster, t: tb}).waitRoutedTo(c.Server(1).ID(), "nobody.here", 50*time.Millisecond)
	})
	require.Regexp(t, `^still waiting after 50ms: server 0: no route from \w+ carries interest in nobody.here yet$`, msg)
	msg = failure(t, func(tb testing.TB) {
		(&Cluster{Cluster: c.Cluster, t: tb}).waitRoutedTo("", "kvactors.e1.register", 50*time.Millisecond)
	})
	require.Equal(t, "wait for interest in kvactors.e1.register routed to no server: the subscriber's client is not connected", msg)
}
