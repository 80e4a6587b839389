package testkit

import (
	"bufio"
	"io"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// echoServer answers every line with itself until the test ends.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	return ln.Addr().String()
}

// roundTrip sends a line through addr and returns what came back, or the
// error that ended the connection (bounded by a deadline).
func roundTrip(t *testing.T, addr string) (string, error) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer c.Close()
	require.NoError(t, c.SetDeadline(time.Now().Add(5*time.Second)))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// A cut link drops its connections and turns new ones away, while keeping
// its port: nothing else can bind it (before, Cut closed the listener and
// Restore listening again could find the port taken), and Restore lets
// connections through on the same address.
func TestALinkKeepsItsPortThroughACut(t *testing.T) {
	l := NewLink(t, echoServer(t))
	got, err := roundTrip(t, l.Addr)
	require.NoError(t, err)
	require.Equal(t, "ping\n", got)

	open, err := net.Dial("tcp", l.Addr)
	require.NoError(t, err)
	defer open.Close()
	_, err = open.Write([]byte("ping\n"))
	require.NoError(t, err)
	_, err = bufio.NewReader(open).ReadString('\n')
	require.NoError(t, err)

	l.Cut()
	require.NoError(t, open.SetDeadline(time.Now().Add(5*time.Second)))
	_, err = open.Read(make([]byte, 1))
	require.ErrorIs(t, err, io.EOF, "a connection through the link drops at the cut")
	_, err = roundTrip(t, l.Addr)
	require.Error(t, err, "a new connection is turned away while cut")
	if ln, err := net.Listen("tcp", l.Addr); err == nil {
		_ = ln.Close()
		t.Fatalf("the cut link's port %s was free to bind", l.Addr)
	}

	l.Restore()
	got, err = roundTrip(t, l.Addr)
	require.NoError(t, err, "through again on the same address")
	require.Equal(t, "ping\n", got)
}
