{{/* Names, labels and the pieces every loop's pod shares. */}}

{{- define "liveloop.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "liveloop.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "liveloop.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "liveloop.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: liveloop
{{- end }}

{{/* Selector labels of one component: (dict "root" $ "component" "serve") */}}
{{- define "liveloop.selectorLabels" -}}
app.kubernetes.io/name: {{ include "liveloop.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "liveloop.componentLabels" -}}
{{ include "liveloop.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "liveloop.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "liveloop.secretName" -}}
{{- .Values.secrets.existingSecret | default (printf "%s-keys" (include "liveloop.fullname" .)) }}
{{- end }}

{{- define "liveloop.redisUrl" -}}
{{- if .Values.valkey.enabled }}
{{- printf "redis://%s-valkey:6379/0" (include "liveloop.fullname" .) }}
{{- else }}
{{- required "valkey.enabled is false: set externalRedisUrl" .Values.externalRedisUrl }}
{{- end }}
{{- end }}

{{- define "liveloop.dbUrl" -}}
{{- if .Values.postgresql.enabled }}
{{- printf "postgresql+psycopg://liveloop@%s-postgresql:5432/liveloop" (include "liveloop.fullname" .) }}
{{- else }}
{{- required "postgresql.enabled is false: set externalDatabase.url" .Values.externalDatabase.url }}
{{- end }}
{{- end }}

{{- define "liveloop.checkpointsClaim" -}}
{{- .Values.checkpoints.existingClaim | default (printf "%s-checkpoints" (include "liveloop.fullname" .)) }}
{{- end }}

{{- define "liveloop.batchesClaim" -}}
{{- .Values.batches.existingClaim | default (printf "%s-batches" (include "liveloop.fullname" .)) }}
{{- end }}

{{/* Environment of every loop: the same LIVELOOP_* variables as everywhere else. */}}
{{- define "liveloop.env" -}}
- name: LIVELOOP_MODEL
  value: {{ .Values.model | quote }}
- name: LIVELOOP_REDIS_URL
  value: {{ include "liveloop.redisUrl" . | quote }}
- name: LIVELOOP_DB_URL
  value: {{ include "liveloop.dbUrl" . | quote }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "liveloop.secretName" . }}
      key: db-password
- name: LIVELOOP_HOST
  value: 0.0.0.0
- name: LIVELOOP_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: LIVELOOP_DATA_DIR
  value: /data
{{- end }}

{{/* Probes on a named port: liveness /healthz, readiness /readyz. */}}
{{- define "liveloop.probes" -}}
livenessProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  initialDelaySeconds: 10
  periodSeconds: 10
  timeoutSeconds: 5
  failureThreshold: 6
readinessProbe:
  httpGet: {path: /readyz, port: {{ .port }}}
  periodSeconds: 5
  timeoutSeconds: 5
  failureThreshold: 3
startupProbe:
  httpGet: {path: /healthz, port: {{ .port }}}
  periodSeconds: 5
  failureThreshold: 60
{{- end }}

{{/* Volumes every loop pod has: the config, the model directories, a scratch /data. */}}
{{- define "liveloop.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "liveloop.fullname" . }}-config
- name: data
  emptyDir: {}
{{- if .Values.models.existingClaim }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .Values.models.existingClaim }}
    readOnly: true
{{- end }}
{{- end }}

{{- define "liveloop.commonMounts" -}}
- name: config
  mountPath: /etc/liveloop
  readOnly: true
- name: data
  mountPath: /data
{{- if .Values.models.existingClaim }}
- name: models
  mountPath: /models
  readOnly: true
{{- end }}
{{- end }}

{{- define "liveloop.configArgs" -}}
- --config
- /etc/liveloop/liveloop.toml
{{- end }}

{{/* JSON list of the SGLang replicas' URLs (one per StatefulSet pod, stable DNS names). */}}
{{- define "liveloop.sglangUrls" -}}
{{- $urls := list }}
{{- $name := printf "%s-sglang" (include "liveloop.fullname" .) }}
{{- range $i := until (int .Values.sglang.replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s:%d" $name $i $name (int $.Values.sglang.port)) }}
{{- end }}
{{- toJson $urls }}
{{- end }}
