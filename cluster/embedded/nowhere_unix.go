//go:build unix

package embedded

import (
	"fmt"
	"syscall"
)

// nowhere is a loopback TCP port bound but not listening: a dial to it is
// refused, and the kernel hands the port to no other socket (a listener, a
// connection's local end) until release. A port merely freed again could
// be taken by a later listener, such as one of the test's own route
// proxies, and a server gossiped that address would dial past the cut.
type nowhere struct {
	fd   int
	port int
}

func reserveNowhere() (*nowhere, error) {
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		return nil, fmt.Errorf("reserve a loopback port: socket: %w", err)
	}
	syscall.CloseOnExec(fd)
	// No SO_REUSEADDR: a listener (Go sets it) cannot share the port.
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("reserve a loopback port: bind: %w", err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		_ = syscall.Close(fd)
		return nil, fmt.Errorf("reserve a loopback port: getsockname: %w", err)
	}
	return &nowhere{fd: fd, port: sa.(*syscall.SockaddrInet4).Port}, nil
}

func (n *nowhere) release() { _ = syscall.Close(n.fd) }
