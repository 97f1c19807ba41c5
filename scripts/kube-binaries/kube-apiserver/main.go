// Command kube-apiserver is Kubernetes' API server, unchanged: the same three lines as
// k8s.io/kubernetes/cmd/kube-apiserver, which cannot be imported (it is a main package).
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	os.Exit(cli.Run(app.NewAPIServerCommand()))
}
