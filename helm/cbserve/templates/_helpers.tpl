{{/* Names and labels. KubeRay appends suffixes to the RayService name, so keep it short. */}}
{{- define "cbserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "cbserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "cbserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "cbserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Checks of values that would otherwise fail later, in KubeRay or in Serve. */}}
{{- define "cbserve.validate" -}}
{{- if lt (int .Values.tp_size) 1 -}}
{{- fail (printf "tp_size must be at least 1, got %v" .Values.tp_size) -}}
{{- end -}}
{{- if .Values.autoscaling.enabled -}}
{{- if lt (int .Values.autoscaling.minReplicas) 0 -}}
{{- fail "autoscaling.minReplicas must be at least 0" -}}
{{- end -}}
{{- if or (lt (int .Values.autoscaling.maxReplicas) 1) (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) -}}
{{- fail (printf "autoscaling: need 1 <= maxReplicas and minReplicas <= maxReplicas, got %v and %v" .Values.autoscaling.minReplicas .Values.autoscaling.maxReplicas) -}}
{{- end -}}
{{- else if lt (int .Values.replicas) 1 -}}
{{- fail "replicas must be at least 1 when autoscaling is disabled" -}}
{{- end -}}
{{- if lt (float64 .Values.worker.extraCpus) (mulf 2.0 (float64 .Values.serve.ingressCpus)) -}}
{{- fail (printf "worker.extraCpus (%v) must cover the ingress and stats board replicas a pod may hold: 2 x serve.ingressCpus = %v" .Values.worker.extraCpus (mulf 2.0 (float64 .Values.serve.ingressCpus))) -}}
{{- end -}}
{{- range $g := include "cbserve.groups" . | fromYamlArray -}}
{{- include "cbserve.checkPodCpus" (dict "root" $ "resources" (include "cbserve.workerResources" (dict "root" $ "group" $g) | fromYaml)) -}}
{{- end -}}
{{- if and .Values.model.download.enabled (not .Values.model.download.uri) -}}
{{- fail "model.download.enabled needs model.download.uri (e.g. s3://bucket/models/NAME)" -}}
{{- end -}}
{{- if and .Values.model.download.enabled .Values.model.volume -}}
{{- fail "model: set either volume or download, not both" -}}
{{- end -}}
{{- if and .Values.networkPolicy.enabled (not .Values.networkPolicy.kuberayOperator.namespace) -}}
{{- fail "networkPolicy.kuberayOperator.namespace must name the KubeRay operator's namespace: it deploys the Serve config through the head's dashboard port, which the NetworkPolicy closes to everyone else" -}}
{{- end -}}
{{- if .Values.batch.enabled -}}
{{- if not .Values.shared.volume -}}
{{- fail "batch.enabled needs shared.volume: the job's results would otherwise be written on its head pod's own disk and lost with it" -}}
{{- end -}}
{{- $root := printf "%s/" (trimSuffix "/" .Values.shared.mountPath) -}}
{{- range $k := list "input" "output" -}}
{{- if not (hasPrefix $root (get $.Values.batch $k)) -}}
{{- fail (printf "batch.%s (%s) must be under shared.mountPath (%s)" $k (get $.Values.batch $k) $.Values.shared.mountPath) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* files/serve_config.yaml (a copy of ray_config.yaml), parsed. */}}
{{- define "cbserve.fileConfig" -}}
{{- $cfg := .Files.Get "files/serve_config.yaml" | fromYaml -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "files/serve_config.yaml: %s" $cfg.Error) -}}
{{- end -}}
{{- if ne (len ($cfg.applications | default list)) 1 -}}
{{- fail "files/serve_config.yaml must hold exactly one application" -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The application's args: the file's, with what depends on the Kubernetes cluster set from the values. */}}
{{- define "cbserve.args" -}}
{{- $app := index (include "cbserve.fileConfig" . | fromYaml).applications 0 -}}
{{- $args := $app.args | default dict -}}
{{- $_ := set $args "tp_size" (int .Values.tp_size) -}}
{{- with .Values.model.name }}{{ $_ := set $args "model" . }}{{ end -}}
{{- with .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end -}}
{{- with .Values.model.dtype }}{{ $_ := set $args "dtype" . }}{{ end -}}
{{- /* the key comes from the Secret through $CBSERVE_API_KEY, never from this ConfigMap-like text */ -}}
{{- $_ := set $args "api_key" nil -}}
{{- if and .Values.apiKey.existingSecret .Values.apiKey.protectMetrics }}{{ $_ := set $args "metrics_require_api_key" true }}{{ end -}}
{{- $worker := $args.worker | default dict -}}
{{- $_ := set $worker "num_gpus" 1 -}}
{{- $_ := set $worker "num_cpus" .Values.worker.cpusPerRank -}}
{{- if .Values.autoscaling.enabled -}}
{{- $auto := $worker.autoscaling | default dict -}}
{{- $_ := set $auto "min_replicas" (int .Values.autoscaling.minReplicas) -}}
{{- $_ := set $auto "max_replicas" (int .Values.autoscaling.maxReplicas) -}}
{{- $_ := set $auto "initial_replicas" (int .Values.autoscaling.minReplicas) -}}
{{- $_ := set $worker "autoscaling" $auto -}}
{{- else -}}
{{- $_ := set $worker "autoscaling" nil -}}
{{- $_ := set $worker "num_replicas" (int .Values.replicas) -}}
{{- end -}}
{{- $_ := set $args "worker" $worker -}}
{{- toYaml (mergeOverwrite $args (deepCopy .Values.serve.args)) -}}
{{- end -}}

{{/*
The Serve config (serveConfigV2): files/serve_config.yaml with the bind address, ports, args
(`cbserve.args`) and the small deployments' CPUs set from the values.
*/}}
{{- define "cbserve.serveConfig" -}}
{{- $cfg := include "cbserve.fileConfig" . | fromYaml -}}
{{- $http := $cfg.http_options | default dict -}}
{{- $_ := set $http "host" "0.0.0.0" -}}
{{- $_ := set $http "port" (int .Values.serve.httpPort) -}}
{{- $_ := set $cfg "http_options" $http -}}
{{- $grpc := $cfg.grpc_options | default dict -}}
{{- $_ := set $grpc "port" (int .Values.serve.grpcPort) -}}
{{- $_ := set $cfg "grpc_options" $grpc -}}
{{- $app := index $cfg.applications 0 -}}
{{- $args := include "cbserve.args" . | fromYaml -}}
{{- $_ := set $app "args" $args -}}
{{- with .Values.serve.runtimeEnv }}{{ $_ := set $app "runtime_env" (deepCopy .) }}{{ end -}}
{{- $deployments := $app.deployments | default list -}}
{{- /* ClusterArgs.ingress_in_worker: then the ingress is inside LLMWorker and has no deployment of its own */ -}}
{{- $placement := $args.ingress_placement | default "auto" -}}
{{- $most := $args.worker.num_replicas | default 1 | int -}}
{{- if kindIs "map" $args.worker.autoscaling -}}{{- $most = $args.worker.autoscaling.max_replicas | default 1 | int -}}{{- end -}}
{{- $inWorker := or (eq $placement "worker") (and (eq $placement "auto") (eq $most 1) (eq (int ($args.ingress_replicas | default 1)) 1)) -}}
{{- range $name := ternary (list "StatsBoard") (list "OpenAIIngress" "StatsBoard") $inWorker -}}
{{- $deployments = append $deployments (dict "name" $name "ray_actor_options" (dict "num_cpus" $.Values.serve.ingressCpus)) -}}
{{- end -}}
{{- $_ := set $app "deployments" $deployments -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The worker groups: `worker.groups`, or one group named `worker.groupName` (a YAML list). */}}
{{- define "cbserve.groups" -}}
{{- $min := ternary .Values.autoscaling.minReplicas .Values.replicas .Values.autoscaling.enabled | int -}}
{{- $max := ternary .Values.autoscaling.maxReplicas .Values.replicas .Values.autoscaling.enabled | int -}}
{{- $out := list -}}
{{- range $i, $g := .Values.worker.groups | default (list (dict "name" .Values.worker.groupName)) -}}
{{- if not $g.name -}}{{- fail (printf "worker.groups[%d] needs a name" $i) -}}{{- end -}}
{{- $group := merge (deepCopy $g) (dict "minReplicas" (ternary $min 0 (eq $i 0)) "maxReplicas" $max) -}}
{{- if gt (int $group.minReplicas) (int $group.maxReplicas) -}}
{{- fail (printf "worker group %s: minReplicas %v > maxReplicas %v" $group.name $group.minReplicas $group.maxReplicas) -}}
{{- end -}}
{{- $out = append $out $group -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/*
Resources of a GPU worker pod (dict "root" $ "group" group): the group's or `worker.resources`
if given, else sized from tp_size; the GPU limit is always tp_size.
*/}}
{{- define "cbserve.workerResources" -}}
{{- $v := .root.Values -}}
{{- $res := deepCopy (.group.resources | default $v.worker.resources | default dict) -}}
{{- if not $res -}}
{{- $tp := int $v.tp_size -}}
{{- $cpu := addf (mulf (float64 $v.worker.cpusPerRank) (float64 $tp)) (float64 $v.worker.extraCpus) -}}
{{- $offload := dig "cpu_offload" "per_node_gib" 0 (include "cbserve.args" .root | fromYaml) -}}
{{- $mem := printf "%dGi" (int (ceil (addf (mulf (float64 $v.worker.memoryPerRankGi) (float64 $tp)) (float64 $offload)))) -}}
{{- $cpuText := ternary (printf "%d" (int $cpu)) (printf "%dm" (int (mulf $cpu 1000.0))) (eq $cpu (float64 (int $cpu))) -}}
{{- $res = dict "requests" (dict "cpu" $cpuText "memory" $mem) "limits" (dict "cpu" $cpuText "memory" $mem) -}}
{{- end -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits "nvidia.com/gpu" (int $v.tp_size) -}}
{{- $_ := set $res "limits" $limits -}}
{{- toYaml $res -}}
{{- end -}}

{{/* A worker pod must hold a whole replica (all its ranks: STRICT_PACK) plus the small deployments. */}}
{{- define "cbserve.checkPodCpus" -}}
{{- $v := .root.Values -}}
{{- $res := .resources -}}
{{- $cpu := dig "requests" "cpu" (dig "limits" "cpu" "" $res) $res | toString -}}
{{- if $cpu -}}
{{- $cores := 0.0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = divf (trimSuffix "m" $cpu | float64) 1000.0 -}}
{{- else -}}
{{- $cores = float64 $cpu -}}
{{- end -}}
{{- $need := addf (mulf (float64 $v.worker.cpusPerRank) (float64 $v.tp_size)) (mulf 2.0 (float64 $v.serve.ingressCpus)) -}}
{{- if lt $cores $need -}}
{{- fail (printf "worker.resources: a GPU worker pod has %v CPUs but a replica needs worker.cpusPerRank x tp_size = %v x %v, plus %v for the ingress and stats board: raise the CPUs or lower worker.cpusPerRank" $cores $v.worker.cpusPerRank $v.tp_size (mulf 2.0 (float64 $v.serve.ingressCpus))) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Volumes of a pod ("worker": with the model's); a YAML list, maybe empty. */}}
{{- define "cbserve.volumes" -}}
{{- $v := .root.Values -}}
{{- $out := list -}}
{{- if and .worker $v.model.volume -}}
{{- $out = append $out (merge (dict "name" "model") (deepCopy $v.model.volume)) -}}
{{- else if and .worker $v.model.download.enabled -}}
{{- $out = append $out (dict "name" "model" "emptyDir" (dict "sizeLimit" $v.model.download.sizeLimit)) -}}
{{- end -}}
{{- with $v.shared.volume -}}
{{- $out = append $out (merge (dict "name" "shared") (deepCopy .)) -}}
{{- end -}}
{{- $out = append $out (include "cbserve.tmpVolume" .root | fromYaml) -}}
{{- with (include "cbserve.nodePoolShm" .root) -}}
{{- $out = append $out (dict "name" "dshm" "emptyDir" (dict "medium" "Memory" "sizeLimit" .)) -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* With cpu_offload.node_pool, a worker pod's /dev/shm (a container's is 64 MiB) holds the
node's shared KV pool: its budget plus 1 Gi for Ray; empty otherwise. */}}
{{- define "cbserve.nodePoolShm" -}}
{{- $offload := dig "cpu_offload" dict (include "cbserve.args" . | fromYaml) -}}
{{- if and (dig "node_pool" false $offload) (gt (float64 (dig "per_node_gib" 0 $offload)) 0.0) -}}
{{- printf "%dGi" (int (ceil (addf (float64 (dig "per_node_gib" 0 $offload)) 1.0))) -}}
{{- end -}}
{{- end -}}

{{- define "cbserve.volumeMounts" -}}
{{- $v := .root.Values -}}
{{- $out := list -}}
{{- if and .worker (or $v.model.volume $v.model.download.enabled) -}}
{{- $out = append $out (dict "name" "model" "mountPath" $v.model.mountPath "readOnly" (not $v.model.download.enabled)) -}}
{{- end -}}
{{- if $v.shared.volume -}}
{{- $out = append $out (dict "name" "shared" "mountPath" $v.shared.mountPath) -}}
{{- end -}}
{{- $out = append $out (dict "name" "tmp" "mountPath" "/tmp") -}}
{{- if include "cbserve.nodePoolShm" .root -}}
{{- $out = append $out (dict "name" "dshm" "mountPath" "/dev/shm") -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The init container copying the weights from an object store (model.download). */}}
{{- define "cbserve.downloadContainer" -}}
{{- $d := .Values.model.download -}}
{{- $dest := printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) (base (trimSuffix "/" $d.uri)) -}}
- name: fetch-weights
  image: {{ $d.image | quote }}
  command: ["sh", "-c"]
  args:
    - aws s3 sync --only-show-errors {{ if $d.endpointUrl }}--endpoint-url {{ $d.endpointUrl | quote }} {{ end }}{{ $d.uri | quote }} {{ $dest | quote }}
  {{- with $d.secretName }}
  envFrom:
    - secretRef:
        name: {{ . | quote }}
  {{- end }}
  env:
    - {name: HOME, value: /tmp}   # the image's is /root, which the pod's non-root user cannot write
  securityContext:
    {{- include "cbserve.containerSecurityContext" . | nindent 4 }}
  volumeMounts:
    - {name: model, mountPath: {{ .Values.model.mountPath | quote }}}
    - {name: tmp, mountPath: /tmp}
{{- end -}}

{{/* A pod template (dict "root" $ "worker" bool "name" container "resources" dict "group" group|nil). */}}
{{- define "cbserve.podTemplate" -}}
{{- $v := .root.Values -}}
{{- $env := include "cbserve.env" .root | trim -}}
{{- $volumes := include "cbserve.volumes" . | fromYamlArray -}}
{{- $mounts := include "cbserve.volumeMounts" . | fromYamlArray -}}
{{- $g := .group | default dict -}}
{{- $side := ternary $v.worker $v.head .worker -}}
metadata:
  labels:
    {{- include "cbserve.labels" .root | nindent 4 }}
    app.kubernetes.io/component: {{ .component }}
spec:
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  {{- /* only the head of an autoscaled cluster calls the Kubernetes API (KubeRay's autoscaler sidecar) */}}
  automountServiceAccountToken: {{ and (not .worker) (eq .component "serving") $v.autoscaling.enabled }}
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with ($g.nodeSelector | default $side.nodeSelector) }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with ($g.tolerations | default $side.tolerations) }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with ($g.affinity | default $side.affinity) }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if and .worker $v.model.download.enabled }}
  initContainers:
    {{- include "cbserve.downloadContainer" .root | nindent 4 }}
  {{- end }}
  {{- with $volumes }}
  volumes:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: {{ .name }}
      image: {{ printf "%s:%s" $v.image.repository ($v.image.tag | toString) | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- include "cbserve.containerSecurityContext" .root | nindent 8 }}
      ports:
        {{- if not .worker }}
        - {name: gcs-server, containerPort: 6379}
        - {name: dashboard, containerPort: 8265}
        - {name: client, containerPort: 10001}
        {{- end }}
        - {name: serve, containerPort: {{ int $v.serve.httpPort }}}
        - {name: grpc, containerPort: {{ int $v.serve.grpcPort }}}
      {{- with .resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $env }}
      env:
        {{- $env | nindent 8 }}
      {{- end }}
      {{- with $mounts }}
      volumeMounts:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/* The head group (dict "root" $ "component" "serving"|"batch"): no CPUs for Ray, it runs no
replica; its Service stays inside the cluster (ClusterIP: the dashboard, GCS and client ports
are code execution). */}}
{{- define "cbserve.headGroup" -}}
{{- $root := .root -}}
{{- $params := merge (dict "num-cpus" "0") (deepCopy $root.Values.head.rayStartParams) (dict "dashboard-host" "0.0.0.0") -}}
serviceType: ClusterIP
rayStartParams:
  {{- include "cbserve.rayStartParams" $params | nindent 2 }}
template:
  {{- include "cbserve.podTemplate" (dict "root" $root "worker" false "name" "ray-head" "resources" $root.Values.head.resources "component" .component) | nindent 2 }}
{{- end -}}

{{/* The GPU worker groups (a YAML list). */}}
{{- define "cbserve.workerGroups" -}}
{{- range $g := include "cbserve.groups" . | fromYamlArray }}
- groupName: {{ $g.name }}
  replicas: {{ int $g.minReplicas }}
  minReplicas: {{ int $g.minReplicas }}
  maxReplicas: {{ int $g.maxReplicas }}
  rayStartParams:
    {{- include "cbserve.rayStartParams" $.Values.worker.rayStartParams | nindent 4 }}
  template:
    {{- $res := include "cbserve.workerResources" (dict "root" $ "group" $g) | fromYaml }}
    {{- include "cbserve.podTemplate" (dict "root" $ "worker" true "name" "ray-worker" "resources" $res "group" $g "component" "serving") | nindent 4 }}
{{- end }}
{{- end -}}

{{/* Environment of every Ray container: the caches' folders, Serve's gRPC message cap (the
proxies read it at start: the app's `limits.max_body_bytes`, as `make serve` sets it; Serve's own
default is 2 GiB), the API key from its Secret, then `env`. */}}
{{- define "cbserve.env" -}}
{{- include "cbserve.cacheEnv" . }}
{{- $limits := (include "cbserve.args" . | fromYaml).limits | default dict }}
{{- with $limits.max_body_bytes }}
- name: RAY_SERVE_GRPC_MAX_MESSAGE_SIZE
  value: {{ int . | toString | quote }}
{{- end }}
{{- if .Values.apiKey.existingSecret }}
- name: CBSERVE_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.apiKey.existingSecret | quote }}
      key: {{ .Values.apiKey.secretKey | quote }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* rayStartParams: a map of strings, as KubeRay requires. */}}
{{- define "cbserve.rayStartParams" -}}
{{- $out := dict -}}
{{- range $k, $v := . }}{{ $_ := set $out $k ($v | toString) }}{{ end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* The emptyDir at /tmp: with a read-only root filesystem, where Ray writes its session (logs,
sockets, spilled objects) and the caches of `cbserve.cacheEnv` live. */}}
{{- define "cbserve.tmpVolume" -}}
{{- $dir := dict -}}
{{- with .Values.tmp.sizeLimit }}{{ $_ := set $dir "sizeLimit" . }}{{ end -}}
{{- toYaml (dict "name" "tmp" "emptyDir" $dir) -}}
{{- end -}}

{{/* A container's securityContext: `containerSecurityContext` with the pod's user. */}}
{{- define "cbserve.containerSecurityContext" -}}
{{- $pod := .Values.podSecurityContext -}}
{{- $out := deepCopy .Values.containerSecurityContext -}}
{{- range $k := list "runAsUser" "runAsGroup" -}}
{{- if and (hasKey $pod $k) (not (hasKey $out $k)) }}{{ $_ := set $out $k (get $pod $k) }}{{ end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}

{{/* With a read-only root filesystem, the caches that would go under $HOME (the image's, read-only)
go under /tmp instead: Triton's compiled kernels, cbserve's C++ CPU kernels and dequantized GGUF
models, CUDA's JIT cache, and the Hugging Face cache (a model given by HF id downloads there). Names
already in `env` are left to it (e.g. HF_HOME pointing at a cache baked into the image). */}}
{{- define "cbserve.cacheEnv" -}}
{{- if .Values.containerSecurityContext.readOnlyRootFilesystem -}}
{{- $given := dict -}}
{{- range .Values.env }}{{ $_ := set $given .name true }}{{ end -}}
{{- $caches := dict "TRITON_CACHE_DIR" "/tmp/cache/triton" "TORCH_EXTENSIONS_DIR" "/tmp/cache/torch_extensions"
    "CBSERVE_CACHE_DIR" "/tmp/cache/cbserve" "CUDA_CACHE_PATH" "/tmp/cache/nv" "HF_HOME" "/tmp/cache/huggingface" -}}
{{- range $name := keys $caches | sortAlpha }}
{{- if not (hasKey $given $name) }}
- {name: {{ $name }}, value: {{ get $caches $name }}}
{{- end }}
{{- end }}
{{- end -}}
{{- end -}}

{{/* Ray's token authentication (KubeRay authOptions): the dashboard, job submission and GCS ask
for a token that KubeRay keeps in a Secret and gives to every Ray container and to itself. */}}
{{- define "cbserve.rayAuth" -}}
{{- if .Values.rayAuth.enabled -}}
{{- if semverCompare "<2.52.0-0" (toString .Values.rayVersion) -}}
{{- fail (printf "rayAuth.enabled needs Ray 2.52.0 or later (token authentication), rayVersion is %v: upgrade the image or set rayAuth.enabled false" .Values.rayVersion) -}}
{{- end -}}
authOptions:
  mode: token
{{- end -}}
{{- end -}}

{{/* The batch job's submitter pod (KubeRay runs `ray job submit` in it). */}}
{{- define "cbserve.submitterPod" -}}
metadata:
  labels:
    {{- include "cbserve.labels" . | nindent 4 }}
    app.kubernetes.io/component: batch-submitter
spec:
  restartPolicy: Never
  securityContext:
    {{- toYaml .Values.podSecurityContext | nindent 4 }}
  automountServiceAccountToken: false
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumes:
    - {{ include "cbserve.tmpVolume" . | fromYaml | toJson }}
  containers:
    - name: ray-job-submitter
      image: {{ printf "%s:%s" .Values.image.repository (.Values.image.tag | toString) | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      resources:
        {{- toYaml .Values.batch.submitterResources | nindent 8 }}
      securityContext:
        {{- include "cbserve.containerSecurityContext" . | nindent 8 }}
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
{{- end -}}
