package config

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzParse: no input makes Parse panic, a failure is an error that says
// something, and a success is a whole Config.
func FuzzParse(f *testing.F) {
	f.Add([]byte(file("", "", "")))
	f.Add([]byte(file("{name: eth0, queues: [0, 1], cpus: [1], frameSize: 4096, numFrames: 1000}", "{kubernetes: {apiServer: \"https://h:1\", qps: 1}}",
		"clusterCIDR: 10.0.0.0/8,fd00::/8\nmasquerade: {portRange: 1000-2000}\nconntrack: {udpTimeout: 1.5, tcpCloseTimeout: 1m}\n")))
	f.Add([]byte("apiVersion: xdproxy.io/v1alpha1\nkind: XDProxyConfiguration\ninterfaces: {a: [1, {b: c}]}\nbatchSize: 1e99\n"))
	f.Add([]byte("a: [\n"))
	if b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "xdproxy.yaml")); err == nil {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := ParseWith(b, Options{Host: &testHost})
		if err != nil {
			if c != nil || err.Error() == "" {
				t.Fatalf("Config %v with error %q", c, err)
			}
			var errs Errors
			if errors.As(err, &errs) && len(errs) == 0 {
				t.Fatal("an empty Errors")
			}
			return
		}
		if c.NodeName == "" || len(c.Interfaces) == 0 || c.Masquerade.Ports.Validate() != nil ||
			(c.Services.File == "") == (c.Services.Kubernetes == nil) {
			t.Fatalf("accepted an incomplete Config %+v", c)
		}
		for _, in := range c.Interfaces {
			if err := in.Socket.Validate(); err != nil {
				t.Fatalf("accepted socket %+v: %v", in.Socket, err)
			}
		}
	})
}
