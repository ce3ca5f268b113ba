package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/micro"
)

// floorSubject is the bare endpoint's subject.
const floorSubject = "bench.floor"

// serveFloor is the bench run as the bare replier (-floor-reply): a micro endpoint in a process of its
// own that answers every request with the same body of n bytes, until its stdin closes.
func serveFloor(url string, n int) error {
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	body := make([]byte, n)
	svc, err := micro.AddService(nc, micro.Config{Name: "bench-floor", Version: "0.0.1"})
	if err != nil {
		return err
	}
	defer func() { _ = svc.Stop() }()
	if err := svc.AddEndpoint("floor", micro.HandlerFunc(func(r micro.Request) { _ = r.Respond(body) }),
		micro.WithEndpointSubject(floorSubject)); err != nil {
		return err
	}
	if err := nc.Flush(); err != nil {
		return err
	}
	fmt.Println("ready")
	_, _ = bufio.NewReader(os.Stdin).ReadString('\n') // the bench closes stdin to stop it
	return nil
}

// replyFloor measures what NATS and two processes alone cost a node lookup: a bare endpoint in another
// process answering a fixed body of the node answer's size, asked as the node lookups are. It returns
// the median and p99.
func (b *bench) replyFloor(size int) (time.Duration, time.Duration, error) {
	self, err := os.Executable()
	if err != nil {
		return 0, 0, err
	}
	cmd := exec.Command(self, "-floor-reply", b.url, "-floor-bytes", strconv.Itoa(size))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 0, 0, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, 0, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return 0, 0, err
	}
	defer func() {
		_ = stdin.Close()
		_ = cmd.Wait()
	}()
	if line, err := bufio.NewReader(stdout).ReadString('\n'); err != nil || line != "ready\n" {
		return 0, 0, fmt.Errorf("floor replier did not start: %q %v", line, err)
	}
	body := []byte{0x81, 0xa4, 'w', 'h', 'a', 't', 0xa5, 'n', 'e', 'e', 'd', 's'} // {"what":"needs"}
	times := make([]time.Duration, 0, b.lookups)
	for i := 0; i < b.lookups; i++ {
		start := time.Now()
		msg, err := b.nc.Request(floorSubject, body, 10*time.Second)
		if err != nil {
			return 0, 0, err
		}
		times = append(times, time.Since(start))
		if len(msg.Data) != size {
			return 0, 0, fmt.Errorf("floor answer of %d bytes, want %d", len(msg.Data), size)
		}
	}
	return percentile(times, 0.5), percentile(times, 0.99), nil
}
