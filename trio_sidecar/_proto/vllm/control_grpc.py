import purerpc
import trio_sidecar._proto.vllm.control_pb2 as vllm_dot_control__pb2


class ControlServicer(purerpc.Servicer):
    async def GetServerInfo(self, input_message):
        raise NotImplementedError()

    async def GetModelInfo(self, input_message):
        raise NotImplementedError()

    async def Abort(self, input_message):
        raise NotImplementedError()

    async def GetKvEventSources(self, input_message):
        raise NotImplementedError()

    async def PauseGeneration(self, input_message):
        raise NotImplementedError()

    async def ResumeGeneration(self, input_message):
        raise NotImplementedError()

    async def IsPaused(self, input_message):
        raise NotImplementedError()

    async def Sleep(self, input_message):
        raise NotImplementedError()

    async def WakeUp(self, input_message):
        raise NotImplementedError()

    async def IsSleeping(self, input_message):
        raise NotImplementedError()

    async def InitWeightTransferEngine(self, input_message):
        raise NotImplementedError()

    async def StartWeightUpdate(self, input_message):
        raise NotImplementedError()

    async def StartDraftWeightUpdate(self, input_message):
        raise NotImplementedError()

    async def UpdateWeights(self, input_message):
        raise NotImplementedError()

    async def FinishWeightUpdate(self, input_message):
        raise NotImplementedError()

    async def UpdateWeightVersion(self, input_message):
        raise NotImplementedError()

    async def GetWeightVersion(self, input_message):
        raise NotImplementedError()

    async def LoadLora(self, input_message):
        raise NotImplementedError()

    async def UnloadLora(self, input_message):
        raise NotImplementedError()

    async def ListLoras(self, input_message):
        raise NotImplementedError()

    async def Shutdown(self, input_message):
        raise NotImplementedError()

    @property
    def service(self) -> purerpc.Service:
        service_obj = purerpc.Service(
            "vllm.Control"
        )
        service_obj.add_method(
            "GetServerInfo",
            self.GetServerInfo,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetServerInfoRequest,
                vllm_dot_control__pb2.ServerInfo,
            )
        )
        service_obj.add_method(
            "GetModelInfo",
            self.GetModelInfo,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetModelInfoRequest,
                vllm_dot_control__pb2.ModelInfo,
            )
        )
        service_obj.add_method(
            "Abort",
            self.Abort,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.AbortRequest,
                vllm_dot_control__pb2.AbortResponse,
            )
        )
        service_obj.add_method(
            "GetKvEventSources",
            self.GetKvEventSources,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetKvEventSourcesRequest,
                vllm_dot_control__pb2.GetKvEventSourcesResponse,
            )
        )
        service_obj.add_method(
            "PauseGeneration",
            self.PauseGeneration,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.PauseGenerationRequest,
                vllm_dot_control__pb2.PauseGenerationResponse,
            )
        )
        service_obj.add_method(
            "ResumeGeneration",
            self.ResumeGeneration,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ResumeGenerationRequest,
                vllm_dot_control__pb2.ResumeGenerationResponse,
            )
        )
        service_obj.add_method(
            "IsPaused",
            self.IsPaused,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.IsPausedRequest,
                vllm_dot_control__pb2.IsPausedResponse,
            )
        )
        service_obj.add_method(
            "Sleep",
            self.Sleep,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.SleepRequest,
                vllm_dot_control__pb2.SleepResponse,
            )
        )
        service_obj.add_method(
            "WakeUp",
            self.WakeUp,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.WakeUpRequest,
                vllm_dot_control__pb2.WakeUpResponse,
            )
        )
        service_obj.add_method(
            "IsSleeping",
            self.IsSleeping,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.IsSleepingRequest,
                vllm_dot_control__pb2.IsSleepingResponse,
            )
        )
        service_obj.add_method(
            "InitWeightTransferEngine",
            self.InitWeightTransferEngine,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.InitWeightTransferEngineRequest,
                vllm_dot_control__pb2.InitWeightTransferEngineResponse,
            )
        )
        service_obj.add_method(
            "StartWeightUpdate",
            self.StartWeightUpdate,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.StartWeightUpdateRequest,
                vllm_dot_control__pb2.StartWeightUpdateResponse,
            )
        )
        service_obj.add_method(
            "StartDraftWeightUpdate",
            self.StartDraftWeightUpdate,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.StartDraftWeightUpdateRequest,
                vllm_dot_control__pb2.StartDraftWeightUpdateResponse,
            )
        )
        service_obj.add_method(
            "UpdateWeights",
            self.UpdateWeights,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UpdateWeightsRequest,
                vllm_dot_control__pb2.UpdateWeightsResponse,
            )
        )
        service_obj.add_method(
            "FinishWeightUpdate",
            self.FinishWeightUpdate,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.FinishWeightUpdateRequest,
                vllm_dot_control__pb2.FinishWeightUpdateResponse,
            )
        )
        service_obj.add_method(
            "UpdateWeightVersion",
            self.UpdateWeightVersion,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UpdateWeightVersionRequest,
                vllm_dot_control__pb2.UpdateWeightVersionResponse,
            )
        )
        service_obj.add_method(
            "GetWeightVersion",
            self.GetWeightVersion,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetWeightVersionRequest,
                vllm_dot_control__pb2.GetWeightVersionResponse,
            )
        )
        service_obj.add_method(
            "LoadLora",
            self.LoadLora,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.LoadLoraRequest,
                vllm_dot_control__pb2.LoadLoraResponse,
            )
        )
        service_obj.add_method(
            "UnloadLora",
            self.UnloadLora,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UnloadLoraRequest,
                vllm_dot_control__pb2.UnloadLoraResponse,
            )
        )
        service_obj.add_method(
            "ListLoras",
            self.ListLoras,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ListLorasRequest,
                vllm_dot_control__pb2.ListLorasResponse,
            )
        )
        service_obj.add_method(
            "Shutdown",
            self.Shutdown,
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ShutdownRequest,
                vllm_dot_control__pb2.ShutdownResponse,
            )
        )
        return service_obj


class ControlStub:
    def __init__(self, channel):
        self._client = purerpc.Client(
            "vllm.Control",
            channel
        )
        self.GetServerInfo = self._client.get_method_stub(
            "GetServerInfo",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetServerInfoRequest,
                vllm_dot_control__pb2.ServerInfo,
            )
        )
        self.GetModelInfo = self._client.get_method_stub(
            "GetModelInfo",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetModelInfoRequest,
                vllm_dot_control__pb2.ModelInfo,
            )
        )
        self.Abort = self._client.get_method_stub(
            "Abort",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.AbortRequest,
                vllm_dot_control__pb2.AbortResponse,
            )
        )
        self.GetKvEventSources = self._client.get_method_stub(
            "GetKvEventSources",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetKvEventSourcesRequest,
                vllm_dot_control__pb2.GetKvEventSourcesResponse,
            )
        )
        self.PauseGeneration = self._client.get_method_stub(
            "PauseGeneration",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.PauseGenerationRequest,
                vllm_dot_control__pb2.PauseGenerationResponse,
            )
        )
        self.ResumeGeneration = self._client.get_method_stub(
            "ResumeGeneration",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ResumeGenerationRequest,
                vllm_dot_control__pb2.ResumeGenerationResponse,
            )
        )
        self.IsPaused = self._client.get_method_stub(
            "IsPaused",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.IsPausedRequest,
                vllm_dot_control__pb2.IsPausedResponse,
            )
        )
        self.Sleep = self._client.get_method_stub(
            "Sleep",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.SleepRequest,
                vllm_dot_control__pb2.SleepResponse,
            )
        )
        self.WakeUp = self._client.get_method_stub(
            "WakeUp",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.WakeUpRequest,
                vllm_dot_control__pb2.WakeUpResponse,
            )
        )
        self.IsSleeping = self._client.get_method_stub(
            "IsSleeping",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.IsSleepingRequest,
                vllm_dot_control__pb2.IsSleepingResponse,
            )
        )
        self.InitWeightTransferEngine = self._client.get_method_stub(
            "InitWeightTransferEngine",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.InitWeightTransferEngineRequest,
                vllm_dot_control__pb2.InitWeightTransferEngineResponse,
            )
        )
        self.StartWeightUpdate = self._client.get_method_stub(
            "StartWeightUpdate",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.StartWeightUpdateRequest,
                vllm_dot_control__pb2.StartWeightUpdateResponse,
            )
        )
        self.StartDraftWeightUpdate = self._client.get_method_stub(
            "StartDraftWeightUpdate",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.StartDraftWeightUpdateRequest,
                vllm_dot_control__pb2.StartDraftWeightUpdateResponse,
            )
        )
        self.UpdateWeights = self._client.get_method_stub(
            "UpdateWeights",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UpdateWeightsRequest,
                vllm_dot_control__pb2.UpdateWeightsResponse,
            )
        )
        self.FinishWeightUpdate = self._client.get_method_stub(
            "FinishWeightUpdate",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.FinishWeightUpdateRequest,
                vllm_dot_control__pb2.FinishWeightUpdateResponse,
            )
        )
        self.UpdateWeightVersion = self._client.get_method_stub(
            "UpdateWeightVersion",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UpdateWeightVersionRequest,
                vllm_dot_control__pb2.UpdateWeightVersionResponse,
            )
        )
        self.GetWeightVersion = self._client.get_method_stub(
            "GetWeightVersion",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.GetWeightVersionRequest,
                vllm_dot_control__pb2.GetWeightVersionResponse,
            )
        )
        self.LoadLora = self._client.get_method_stub(
            "LoadLora",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.LoadLoraRequest,
                vllm_dot_control__pb2.LoadLoraResponse,
            )
        )
        self.UnloadLora = self._client.get_method_stub(
            "UnloadLora",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.UnloadLoraRequest,
                vllm_dot_control__pb2.UnloadLoraResponse,
            )
        )
        self.ListLoras = self._client.get_method_stub(
            "ListLoras",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ListLorasRequest,
                vllm_dot_control__pb2.ListLorasResponse,
            )
        )
        self.Shutdown = self._client.get_method_stub(
            "Shutdown",
            purerpc.RPCSignature(
                purerpc.Cardinality.UNARY_UNARY,
                vllm_dot_control__pb2.ShutdownRequest,
                vllm_dot_control__pb2.ShutdownResponse,
            )
        )