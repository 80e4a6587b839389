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
