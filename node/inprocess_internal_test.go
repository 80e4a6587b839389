package node

import (
	"context"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"
)

// With the embedded server the node's own connection is in-process (no
// loopback socket: two syscalls and a netpoll wake-up less per message
// each way); with --nats it is the URL's.
func TestEmbeddedServerConnectionIsInProcess(t *testing.T) {
	t.Parallel()
	n, err := Start(context.Background(), Config{NATSPort: -1, NATSStoreDir: t.TempDir(), ShmDir: t.TempDir(),
		PoolBytes: 1 << 20, HTTPAddr: "off", Log: slog.New(slog.NewTextHandler(io.Discard, nil))})
	require.NoError(t, err)
	t.Cleanup(func() { _ = n.Close(context.Background()) })

	require.Equal(t, "pipe", n.nc.ConnectedAddr(), "the node's connection to its embedded server is a net.Pipe")
	require.Equal(t, n.ns.ClientURL(), n.nc.ConnectedUrl(), "its URL, as logged, is the server's")
	require.NoError(t, n.nc.Publish("kvactors.probe", []byte("x")))
	require.NoError(t, n.nc.Flush(), "and it carries messages")
}
