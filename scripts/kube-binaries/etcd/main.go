// Command etcd is etcd's server, unchanged: etcd's own main is in its top-level module, which
// cannot be required on its own, so this calls the same entry point.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
