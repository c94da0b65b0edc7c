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
{{- /* A worker pod must hold a whole replica (all its ranks: STRICT_PACK) plus the small deployments. */ -}}
{{- $res := .Values.worker.resources | default dict -}}
{{- $cpu := dig "limits" "cpu" (dig "requests" "cpu" "" $res) $res | toString -}}
{{- if $cpu -}}
{{- $cores := 0.0 -}}
{{- if hasSuffix "m" $cpu -}}
{{- $cores = divf (trimSuffix "m" $cpu | float64) 1000.0 -}}
{{- else -}}
{{- $cores = float64 $cpu -}}
{{- end -}}
{{- $need := addf (mulf (float64 .Values.worker.cpusPerRank) (float64 .Values.tp_size)) (mulf 2.0 (float64 .Values.serve.ingressCpus)) -}}
{{- if lt $cores $need -}}
{{- fail (printf "worker.resources: a GPU worker pod has %v CPUs but a replica needs worker.cpusPerRank x tp_size = %v x %v, plus %v for the ingress and stats board: raise the CPUs or lower worker.cpusPerRank" $cores .Values.worker.cpusPerRank .Values.tp_size (mulf 2.0 (float64 .Values.serve.ingressCpus))) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The Serve config (serveConfigV2): files/serve_config.yaml (a copy of ray_config.yaml) with what
depends on the Kubernetes cluster set from the values.
*/}}
{{- define "cbserve.serveConfig" -}}
{{- $cfg := .Files.Get "files/serve_config.yaml" | fromYaml -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "files/serve_config.yaml: %s" $cfg.Error) -}}
{{- end -}}
{{- $http := $cfg.http_options | default dict -}}
{{- $_ := set $http "host" "0.0.0.0" -}}
{{- $_ := set $http "port" (int .Values.serve.httpPort) -}}
{{- $_ := set $cfg "http_options" $http -}}
{{- $grpc := $cfg.grpc_options | default dict -}}
{{- $_ := set $grpc "port" (int .Values.serve.grpcPort) -}}
{{- $_ := set $cfg "grpc_options" $grpc -}}
{{- $apps := $cfg.applications | default list -}}
{{- if ne (len $apps) 1 -}}
{{- fail "files/serve_config.yaml must hold exactly one application" -}}
{{- end -}}
{{- $app := index $apps 0 -}}
{{- $args := $app.args | default dict -}}
{{- $_ := set $args "tp_size" (int .Values.tp_size) -}}
{{- with .Values.model.name }}{{ $_ := set $args "model" . }}{{ end -}}
{{- with .Values.model.servedModelName }}{{ $_ := set $args "served_model_name" . }}{{ end -}}
{{- with .Values.model.dtype }}{{ $_ := set $args "dtype" . }}{{ end -}}
{{- /* the key comes from the Secret through $CBSERVE_API_KEY, never from this ConfigMap-like text */ -}}
{{- $_ := set $args "api_key" nil -}}
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
{{- $args = mergeOverwrite $args (deepCopy .Values.serve.args) -}}
{{- $_ := set $app "args" $args -}}
{{- with .Values.serve.runtimeEnv }}{{ $_ := set $app "runtime_env" (deepCopy .) }}{{ end -}}
{{- $deployments := $app.deployments | default list -}}
{{- range $name := list "OpenAIIngress" "StatsBoard" -}}
{{- $deployments = append $deployments (dict "name" $name "ray_actor_options" (dict "num_cpus" $.Values.serve.ingressCpus)) -}}
{{- end -}}
{{- $_ := set $app "deployments" $deployments -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* Environment of every Ray container: the API key from its Secret, then `env`. */}}
{{- define "cbserve.env" -}}
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
